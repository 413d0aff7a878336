"""A local team stack (make team-up): the real servers a team runs, started on loopback
ports for trying and testing trainyard as a team. Outside the wheel, like benchmarks/."""
