"""The profiler, ``python -m ptxattn profile``, run from a checkout: ``python scripts/profile.py
[options]`` (ptxattn/tools/profile.py has the options)."""

import os
import sys

# This file's name shadows the standard library's `profile`, which cProfile (imported by torch)
# loads: keep this folder off the import path, and the checkout on it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from ptxattn.tools.profile import main  # noqa: E402  (after the path fix)

if __name__ == "__main__":
    sys.exit(main())
