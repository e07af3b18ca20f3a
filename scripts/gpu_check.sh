#!/usr/bin/env bash
# What to run on a GPU machine before calling a kernel change done: warm the compile cache for
# this GPU's arch in parallel (so that the test workers do not compile the same kernels side by
# side), run the whole test suite (GPU tests included) and the profiler. Logs and the profiler's
# JSON go to ${OUT:-.}; arguments go to pytest (e.g. a subset of tests/ under a time limit).
set -uo pipefail
out=${OUT:-.}
jobs=${JOBS:-8}
arch=$(python3 -c "from ptxattn.runtime import device_arch; print(device_arch())") || exit 1
python3 -m ptxattn kernels --arch "$arch" --warm --jobs "$jobs" > "$out/kernels.txt" 2>&1
echo "kernels --arch $arch --warm: exit $?"
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n $jobs")
python3 -m pytest -q $xdist -rfE "$@" 2>&1 | tee "$out/pytest.log" | tail -25
python3 scripts/profile.py ${PROFILE_ARGS:-} --json "$out/profile.json" 2>&1 | tee "$out/profile.log" | tail -45
