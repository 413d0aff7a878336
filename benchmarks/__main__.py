"""``python -m benchmarks``: see benchmarks.main."""

from benchmarks.main import main

if __name__ == "__main__":
    main()
