"""python -m cp_cache demo | bench | doctor"""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
