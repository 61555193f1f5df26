#!/usr/bin/env bash
# Mutation testing of one module with mutmut 3.8.1 (docs/testing.md).
# Usage: tests/mutation/run.sh MODULE [MUTANT_NAME...]   MODULE: codec | rope | attention | diagnose | state | layer.
# Mutant names (or globs) after it run only those mutants (e.g. an earlier run's survivors, after tests were added).
# The run happens in a copy of src/, tests/ and pyproject.toml under ${MUTATION_DIR:-/tmp/sinklab-mutation}/MODULE,
# whose pyproject gets a [tool.mutmut] table that mutates the one module and selects only the fast tests of it.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
case "${1:-}" in
  codec)     src=src/sinklab/kvquant/codec.py; tests='"tests/test_kvquant.py", "tests/test_mutants_codec.py"' ;;
  rope)      src=src/sinklab/rope.py;          tests='"tests/test_stream.py::test_rotate_matches_the_models_own_rope",
    "tests/test_stream.py::test_rotate_pairs_equals_a_complex_rotation",
    "tests/test_stream.py::test_start_position_four_million_stays_float64_accurate",
    "tests/test_stream.py::test_matches_float64_reference_past_eviction[gpt-neox-partial-rotary-4]",
    "tests/test_stream.py::test_matches_float64_reference_past_eviction[llama-yarn-2]",
    "tests/test_stream.py::test_gptj_interleaved_rope_streams_consistently", "tests/test_mutants_rope.py"' ;;
  attention) src=src/sinklab/attention.py;     tests='"tests/test_attention.py", "tests/test_mutants_attention.py"' ;;
  diagnose)  src=src/sinklab/diagnose.py;      tests='"tests/test_diagnose.py", "tests/test_diagnose_reference.py", "tests/test_mutants_diagnose.py"' ;;
  state)     src=src/sinklab/stream/state.py;  tests='"tests/test_stream.py", "tests/test_stream_checks.py",
    "tests/test_stream_generate_modes.py", "tests/test_stream_rotary_layouts.py", "tests/test_mutants_state.py",
    "tests/test_stream_compile.py::test_step_plan_that_cannot_compile_runs_eagerly_with_a_warning",
    "tests/test_variants_everywhere.py::test_sinkcache_stream_matches_float64_reference",
    "tests/test_kvquant_stream.py", "tests/test_stream_plans.py"' ;;
  layer)     src=src/sinklab/stream/layer.py;  tests='"tests/test_stream.py", "tests/test_stream_checks.py",
    "tests/test_stream_generate_modes.py", "tests/test_stream_rotary_layouts.py", "tests/test_mutants_layer.py",
    "tests/test_stream_plans.py"' ;;
  *) echo "usage: $0 codec|rope|attention|diagnose|state|layer" >&2; exit 2 ;;
esac
work=${MUTATION_DIR:-/tmp/sinklab-mutation}/$1
rm -rf "$work" && mkdir -p "$work"
cp -r "$root/src" "$root/tests" "$work/"
find "$work" -name __pycache__ -prune -exec rm -rf {} +
# mutmut forks one worker per mutant from a process that already ran the tests: torch must stay single-threaded
# there (a forked child that enters an OpenMP region its parent had started hangs), so the copy's conftest asks
# for one thread after setting its own
printf '\ntorch.set_num_threads(1)  # tests/mutation/run.sh: forked workers\n' >> "$work/tests/conftest.py"
# the project's pyproject without any [tool.mutmut] table, plus this module's
python3 - "$root/pyproject.toml" "$work/pyproject.toml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
open(sys.argv[2], "w").write(re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[|\Z)", "", text))
PY
# test files that do not exist yet (before the module's test_mutants_*.py) are dropped from the selection
# MUTATION_BASELINE=1 leaves out the tests written from mutation runs (test_mutants_*.py): the score before them
sel=$(cd "$work" && for t in $(echo "$tests" | tr -d '",'); do
  if [ -e "${t%%::*}" ] && { [ -z "${MUTATION_BASELINE:-}" ] || [[ $t != tests/test_mutants_* ]]; }; then
    printf '"%s", ' "$t"; fi; done)
cat >> "$work/pyproject.toml" <<TOML

[tool.mutmut]
source_paths = ["src/"]
only_mutate = ["$src"]
pytest_add_cli_args_test_selection = [${sel%, }]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:randomly", "-o", "addopts=-q"]
use_git_change_detection = false
# a shared, loaded machine: wall-clock limit (estimated test time + 1 s) × 60 instead of × 15
timeout_multiplier = 60.0
TOML
cd "$work"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
shift
nice -n 15 "$root/.venv/bin/mutmut" run --max-children "${MUTATION_JOBS:-2}" "$@"
"$root/.venv/bin/mutmut" results --all true > results.txt || true
