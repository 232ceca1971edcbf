"""python -m cp_cache (also the console script cp-cache): demo | bench | compare | doctor | selftest"""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
