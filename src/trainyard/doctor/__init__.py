"""trainyard doctor: this machine, and what trainyard will do on it."""
