"""cupy_rope test suite (a package so that test modules share tests/helpers.py)."""
