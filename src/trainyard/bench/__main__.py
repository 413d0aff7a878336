"""``python -m trainyard.bench``: see trainyard.bench.cli."""

from trainyard.bench.cli import main

if __name__ == "__main__":
    main()
