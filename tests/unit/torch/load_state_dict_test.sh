#!/usr/bin/env bash
# torch_state_dict_python: the torch_bridge test case that writes a model-only checkpoint of a
# libtorch model (and the model's output on a probe), then PyTorch loads it strict and computes the
# same output (load_state_dict.py). Skipped (exit 77) when no Python here has both torch and
# safetensors, saying why; never passed without the check.
#   load_state_dict_test.sh TORCH_BRIDGE
# The Python: $TANDEM_PYTHON, tandem-python (scripts/setup.sh makes it: Debian's Python with its
# torch, and safetensors), python3 or /usr/bin/python3, the first that has both. Failing that, one
# with torch is given another one's safetensors package on PYTHONPATH (safetensors is one abi3
# extension module), for a machine set up before setup.sh made tandem-python.
set -euo pipefail
bridge=$1
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/tandem-state-dict.XXXXXX)
trap 'rm -rf "$work"' EXIT

TANDEM_TORCH_STATE_DICT_DIR=$work "$bridge" --test-case='*state_dict keys*' >"$work/bridge.log" 2>&1 || {
  cat "$work/bridge.log"; echo "FAILED: torch_bridge did not write the checkpoint"; exit 1; }
[[ -f $work/model.safetensors && -f $work/expected.safetensors ]] || {
  cat "$work/bridge.log"; echo "FAILED: torch_bridge ran no test case that writes the files"; exit 1; }

candidates=()
[[ -n ${TANDEM_PYTHON:-} ]] && candidates+=("$TANDEM_PYTHON")
candidates+=(tandem-python python3 /usr/bin/python3)
# Where each package lies, found without importing it (importing torch takes seconds).
where() {
  "$1" -c "import importlib.util as u, os; s = u.find_spec('$2'); print(os.path.dirname(s.origin) if s else '')" 2>/dev/null
}
python="" with_torch="" safetensors_dir=""
for candidate in "${candidates[@]}"; do
  command -v "$candidate" >/dev/null 2>&1 || continue
  torch_dir=$(where "$candidate" torch) safetensors_here=$(where "$candidate" safetensors)
  if [[ -n $torch_dir && -n $safetensors_here ]]; then python=$candidate; break; fi
  [[ -z $with_torch && -n $torch_dir ]] && with_torch=$candidate
  [[ -z $safetensors_dir && -n $safetensors_here ]] && safetensors_dir=$safetensors_here
done
if [[ -z $python && -n $with_torch && -n $safetensors_dir ]]; then
  mkdir "$work/path"
  ln -s "$safetensors_dir" "$work/path/safetensors"
  export PYTHONPATH=$work/path${PYTHONPATH:+:$PYTHONPATH}
  python=$with_torch
fi
if [[ -z $python ]]; then
  echo "SKIPPED: no Python with both torch and safetensors (tried: ${candidates[*]};" \
       "torch in: ${with_torch:-none}; safetensors in: ${safetensors_dir:-none})." \
       "Set TANDEM_PYTHON to one that has both."
  exit 77
fi
echo "python: $python${PYTHONPATH:+ (PYTHONPATH=$PYTHONPATH)}"
# Debian's torch warns about its NumPy on import: its stderr is shown only when the check fails.
status=0
"$python" "$here/load_state_dict.py" "$work/model.safetensors" "$work/expected.safetensors" \
  2>"$work/python.log" || status=$?
if [[ $status -ne 0 && $status -ne 77 ]]; then cat "$work/python.log"; echo "FAILED: see above"; fi
exit "$status"
