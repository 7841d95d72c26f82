#!/usr/bin/env bash
# One GPU session for prepack: the GPU tests, then the training benchmark, results into $OUT as they come.
#
#     bash benchmarks/gpu_session.sh            # from the repository root of a copy of the tree, on the GPU machine
#
# The machine (shared/notes/gpu.md) has torch with CUDA, Python 3.12, numba, pyarrow, typer and rich, and no
# package access; transformers 5.24, pydantic and FlashAttention-4 are installed into $SITE (default /tmp/site)
# beforehand. $SITE goes on PYTHONPATH, and every Python here starts through a launcher that calls
# site.addsitedir($SITE) first, so that its .pth files are read (the CuTe DSL's `cutlass` frontend needs one).
#
# Time budget, 10.5 minutes at most, every part bounded by `timeout`:
#    30 s  probe: versions, the device, which kernels import                  -> $OUT/probe.txt
#   180 s  pytest -m gpu (tests/model/test_gpu_*.py; FA4 compiles each kernel shape on first use, flex each
#          shape of each model: flex is most of it)
#                                                                              -> $OUT/pytest.txt, pytest-junit.xml
#   180 s  benchmarks/bench_gpu_train.py (--budget-s 120: no contender starts after that, the one running
#          finishes)                                                           -> $OUT/bench/results.jsonl, results.md
#   240 s  the compiled columns: bench_gpu_train.py on FA4, HF flattening against prepack's fixed-shape batches,
#          eager, compiled (`default`) and CUDA-graphed (`reduce-overhead`), graphs counted (--budget-s 180)
#                                                                              -> $OUT/bench-compiled/results.jsonl, results.md
# The script's own log is $OUT/session.log; it exits 0 when every part ran, else the first failing part's code.
# BENCH_ARGS replaces the benchmark's arguments (e.g. "--cpu-smoke" to try the whole script on a CPU);
# COMPILED_ARGS the compiled part's (e.g. without --attn for every kernel, when the lease is long);
# TESTS_LIMIT, BENCH_LIMIT and COMPILED_LIMIT replace the parts' limits in seconds, PYTEST_ARGS adds to pytest's
# arguments (e.g. -k to leave cases out when the lease is short); PYTHON picks the interpreter (default python3).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-session-out}
SITE=${SITE:-/tmp/site}
PYTHON=${PYTHON:-python3}
BENCH_ARGS=${BENCH_ARGS:---warmup 2 --steps 8 --budget-s 120}
TESTS_LIMIT=${TESTS_LIMIT:-180}
BENCH_LIMIT=${BENCH_LIMIT:-180}
COMPILED_ARGS=${COMPILED_ARGS:---attn flash_attention_4 --methods hf-flattening prepack-fixed --compile none default reduce-overhead --warmup 3 --steps 8 --budget-s 180}
COMPILED_LIMIT=${COMPILED_LIMIT:-240}
PYTEST_ARGS=${PYTEST_ARGS:-}
mkdir -p "$OUT/bench" "$OUT/bench-compiled"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
status=0
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/session.log"; }

# The launcher: $SITE's .pth files first, then a script, `-m module` or `-c code`, as python would run it.
cat > "$WORK/launch.py" <<'EOF'
import runpy, site, sys
site.addsitedir(sys.argv[1])
args = sys.argv[2:]
if args[0] == "-m":
    sys.argv = args[1:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
elif args[0] == "-c":
    sys.argv = ["-c", *args[2:]]
    exec(compile(args[1], "<-c>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
EOF
py() { local limit=$1; shift; timeout -k 10 "$limit" "$PYTHON" "$WORK/launch.py" "$SITE" "$@"; }
part() {  # part NAME SECONDS COMMAND...: run one bounded part, log how it ended
    local name=$1 limit=$2; shift 2
    local start=$SECONDS code
    log "$name: start (limit ${limit} s)"
    "$@"
    code=$?
    [ "$code" = 124 ] && log "$name: TIMED OUT after ${limit} s" || log "$name: exit $code after $((SECONDS - start)) s"
    [ "$status" = 0 ] && [ "$code" != 0 ] && status=$code
    return 0
}

# prepack reads its version from installed metadata: where the tree is not installed, a minimal record of it.
if ! py 30 -c "import prepack" 2>/dev/null; then
    py 30 -c '
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
name, version = project["name"], project["version"]
record = pathlib.Path(sys.argv[1]) / (name.replace("-", "_") + "-" + version + ".dist-info")
record.mkdir(parents=True)
(record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
' "$WORK/meta" && export PYTHONPATH="$PYTHONPATH:$WORK/meta" && log "prepack: not installed; metadata record in $WORK/meta"
fi

probe() {
    py 30 -c '
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "transformers", "pydantic", "numba", "pyarrow", "pytest", "prepack", "flash_attn.cute"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as exc:
        print(name, "MISSING", type(exc).__name__, exc)
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
from transformers.utils import is_flash_attn_4_available
print("flash_attention_4 usable:", is_flash_attn_4_available())
' 2>&1 | tee "$OUT/probe.txt"
    return "${PIPESTATUS[0]}"
}
gpu_tests() {
    # shellcheck disable=SC2086 (PYTEST_ARGS is a list of arguments)
    py "$TESTS_LIMIT" -m pytest -m gpu tests/model/test_gpu_*.py $PYTEST_ARGS -p no:cacheprovider -rA -o addopts="" --junitxml="$OUT/pytest-junit.xml" \
        2>&1 | tee "$OUT/pytest.txt"
    return "${PIPESTATUS[0]}"
}
bench() {
    # shellcheck disable=SC2086 (BENCH_ARGS is a list of arguments)
    py "$BENCH_LIMIT" benchmarks/bench_gpu_train.py --out "$OUT/bench" $BENCH_ARGS 2>&1 | tee "$OUT/bench/bench.txt"
    return "${PIPESTATUS[0]}"
}
bench_compiled() {
    # shellcheck disable=SC2086 (COMPILED_ARGS is a list of arguments)
    py "$COMPILED_LIMIT" benchmarks/bench_gpu_train.py --out "$OUT/bench-compiled" $COMPILED_ARGS 2>&1 | tee "$OUT/bench-compiled/bench.txt"
    return "${PIPESTATUS[0]}"
}

log "gpu session: OUT=$OUT SITE=$SITE PYTHON=$PYTHON BENCH_ARGS=$BENCH_ARGS COMPILED_ARGS=$COMPILED_ARGS"
part probe 30 probe
part gpu-tests "$TESTS_LIMIT" gpu_tests
part benchmark "$BENCH_LIMIT" bench
part compiled "$COMPILED_LIMIT" bench_compiled
log "gpu session: done in $SECONDS s, status $status"
exit "$status"
