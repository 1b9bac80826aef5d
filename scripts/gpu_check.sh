#!/usr/bin/env bash
# The CUDA check of convert and validate, for one GPU machine with torch (CUDA build) installed and no network.
#
#   scripts/gpu_check.sh [WHEELS_DIR] [WORK_DIR]
#
# WHEELS_DIR (default: gpu-wheels/ in the repository root) holds the wheels of everything mtpquant needs
# except torch: nvidia-modelopt 0.47, transformers 5.19, accelerate, safetensors, huggingface_hub,
# tokenizers, tqdm, pyyaml, ... and mtpquant itself. Build it on a machine with network access (the same
# Python minor version as the GPU machine's) with:  scripts/gpu_wheels.sh gpu-wheels 3.11
# The check installs them into a venv that sees the system's torch (--system-site-packages), then, each step
# timed and under a time bound (the whole check: under 8 minutes on one H100/H200 class GPU):
#   1. writes the full-size Qwen3.5-4B (real layout, random-normal weights, 9.3 GB) into WORK_DIR
#   2. converts the trained tiny model and that 4B with --device cuda
#   3. converts both again with --device cuda --max-memory cuda:0=2GiB (forcing CPU/disk offload and
#      layer-wise calibration), and checks the two 4B outputs are the same tensors, byte for byte
#   4. validates the tiny model's quant against its source with --device cuda
#   5. converts the trained tiny Qwen3.8-Flash-Next (mtpquant/assets/tiny-qwen4_exp-mtp) with --device cuda, MTP
#      kept and quantized, and validates the quantized MTP's drafts; with GPU_CHECK_VLLM_PYTHON, serves both with
#      MTP (k = 1 and 3) and prints vLLM's acceptance (/metrics) beside validate's prediction, failing where they
#      differ by more than the engine test's tolerance (AL within max(0.1, 0.05 k))
#      The same for the trained tiny GLM-4.5-layout model (mtpquant/assets/tiny-glm4_moe-mtp): its NVFP4 routed
#      experts (main model and quantized MTP) have no kernel in vLLM's CPU build, so its all-NVFP4 keep and quantize
#      outputs are served here (tests/test_engine_nextn.py serves both on the CPU with the routed experts BF16)
#   5a. the precision search on the trained tiny Qwen3.5-MoE (mtpquant/assets/tiny-qwen3_5_moe-mtp): convert --mtp auto
#      (budget 0.05 AL, vLLM's rules) and --keep-mtp with --device cuda (the same calibration: the same target); with
#      GPU_CHECK_VLLM_PYTHON, validate serves the keep output (the BF16 MTP) as reference and the auto output as
#      candidate on the same 32 prompts (k = 1 and 3) and fails unless the auto MTP's engine AL is within the budget
#      + 0.1 of the BF16 MTP's at each k (the MoE's NVFP4 routed experts have no kernel in vLLM's CPU build: #38's
#      engine half for the MoE runs only here)
#   5b. heals the tiny model's quant (its BF16 MTP) with --device cuda, the default schedule (--force: written even if
#      the check finds no gain, so the step times the whole path) and prints the held-out AL before and after
#   5c. heals the tiny Qwen3.8-Flash-Next's quantize convert (its NVFP4 MTP) the same way; with GPU_CHECK_VLLM_PYTHON,
#      serves the healed quant beside the unhealed one (the same 16 prompts, k = 1 and 3) and prints vLLM's AL for
#      both: heal's gain as the engine measures it (this family has no CPU path in vLLM)
#   6. with GPU_CHECK_VLLM_PYTHON set (a python with vLLM >= 0.32, CUDA build): the Qwen3.8-Flash-Next
#      (qwen4_exp) serve check, scripts/qwen4_exp_serve_check.py: vLLM started with MTP on the tiny qwen4_exp and
#      on the published quant layouts (NVIDIA's MIXED_PRECISION, its refreshed metadata before and after
#      `graft --fix-metadata`, ...), each outcome compared with inspect's verdict (the family has no CPU path in
#      vLLM or SGLang, so this is its only engine check); GPU_CHECK_QWEN4_EXP=DIR adds a real checkpoint
#   6b. with GPU_CHECK_VLLM_PYTHON: the DeepSeek MTP serve check, scripts/nextn_serve_check.py: vLLM started with MTP
#      on the tiny DeepSeek-V3 with DeepSeek's own MLA dimensions (its CPU build cannot run MLA), on a copy that lost
#      its MTP (inspect predicts "MTP speculative decoding layer 2 weights missing from checkpoint"), and after graft
#      put it back from the BF16 checkpoint and from SGLang's standalone NextN form (mtpquant extract --nextn); each
#      outcome compared with inspect's verdict; GPU_CHECK_DEEPSEEK=DIR adds a real checkpoint
#   7. (with GPU_CHECK_SGLANG_PYTHON, the python of an SGLang GPU environment, e.g. one made from the
#      lmsysorg/sglang image or `pip install sglang` on a machine with network) NVFP4 + SGLang, which no CPU can
#      run (`Invalid quantization method on CPU: modelopt_fp4`): the tiny model converted in each MTP mode and
#      format mtpquant writes (ModelOpt NVFP4 keep and quantize, FP8 MTP as MIXED_PRECISION, compressed-tensors
#      keep and quantize) is served by SGLang with NEXTN (`validate --engine sglang`, k = 2), and what SGLang does
#      is checked against inspect's SGLang verdict: "MTP loads" must start and draft (AL > 1.3 on the tiny
#      model), "will fail to load" must fail to start (exit 44), "wrong MTP" must draft badly
#   8. (with a trtllm-serve on PATH, or GPU_CHECK_TRTLLM_SERVE naming the trtllm-serve of a TensorRT-LLM GPU
#      environment, e.g. the nvcr.io/nvidia/tensorrt-llm/release image; skipped without one) NVFP4 + TensorRT-LLM: the
#      tiny model's keep output (converted in step 2, its MTP BF16) and its --mtp quantize output (NVFP4 MTP) are each
#      served with MTP (inspect's own trtllm-serve line: --extra_llm_api_options with decoding_type MTP,
#      num_nextn_predict_layers 2) and measured through it (`validate --server`: the OpenAI API for the requests,
#      /prometheus/metrics's cumulative counters for AL; no acceptance per position); what TensorRT-LLM does is
#      checked against inspect's TensorRT-LLM verdict: "MTP loads" must serve and draft (AL > 1.3), "will fail to
#      load" must fail to start
# and prints, per step, the wall time, the peak RSS and the peak GPU memory. Record what it prints in
# docs/BENCHMARKS.md ("CUDA check"). Set GPU_CHECK_SKIP_INSTALL=1 to use the current python as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-gpu-wheels}
WORK=${2:-${TMPDIR:-/tmp}/mtpquant-gpu-check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}  # cpu: a dry run of this script's own logic on a machine without a GPU
CAP=cuda:0=2GiB
[[ "$DEVICE" == "cpu" ]] && CAP=cpu=3GiB
mkdir -p "$WORK"
T0=$(date +%s)

if [[ "${GPU_CHECK_SKIP_INSTALL:-0}" == "1" ]]; then
  PY=${PYTHON:-python3}
else
  python3 -m venv --system-site-packages "$WORK/venv"
  PY="$WORK/venv/bin/python"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps "$WHEELS"/mtpquant-*.whl
  # mtpquant's requirements (its wheel's metadata: the pins of pyproject.toml) less torch, whose CUDA build the
  # system provides (it satisfies modelopt and accelerate)
  mapfile -t REQS < <("$PY" -c 'from importlib.metadata import requires
for r in requires("mtpquant") or []:
    if "extra ==" not in r and not r.startswith("torch"):
        print(r)')
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${REQS[@]}"
fi
export HF_HUB_OFFLINE=1 TQDM_DISABLE=1

"$PY" - "$DEVICE" <<'EOF'
import sys, torch
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 1e9:.1f} GB")
else:
    print(f"torch {torch.__version__}, device {sys.argv[1]} (a dry run of the script)")
EOF

SCALE=1
[[ "$DEVICE" == "cpu" ]] && SCALE=4  # the CPU dry run is slower than a GPU
step() {  # step NAME TIMEOUT_S CMD...: run, time, keep the JSON result for the summary
  local name=$1 limit=$(( $2 * SCALE )); shift 2
  local t=$(date +%s%N)
  if ! timeout "$limit" "$@" >"$WORK/$name.json" 2>"$WORK/$name.log"; then
    echo "FAILED: $name (see $WORK/$name.log)"; tail -5 "$WORK/$name.log"; exit 1
  fi
  echo "$name $(( ($(date +%s%N) - t) / 1000000 ))" >>"$WORK/walls.txt"  # milliseconds
}
: >"$WORK/walls.txt"

SRC4B=${GPU_CHECK_SRC4B:-$WORK/qwen35-4b-normal}
[[ -d "$SRC4B" ]] || step make-4b 240 "$PY" scripts/make_skeleton_checkpoint.py --layout Qwen3.5-4B --out "$SRC4B" \
  --mtp-data normal --json
TINY=mtpquant/assets/tiny-qwen3_5-mtp
CAL=(--calib-samples 16 --calib-seq-len 256)
[[ "$DEVICE" == "cpu" ]] && CAL=(--calib-samples 4 --calib-seq-len 64)  # what the CPU benchmark uses
C=("$PY" -m mtpquant convert --keep-mtp --device "$DEVICE" --overwrite --json)
step tiny 60 "${C[@]}" "$TINY" "$WORK/tiny-q" "${CAL[@]}"
step tiny-capped 60 "${C[@]}" "$TINY" "$WORK/tiny-q-capped" "${CAL[@]}" --max-memory "$CAP"
step 4b 180 "${C[@]}" "$SRC4B" "$WORK/4b-q" "${CAL[@]}"
step 4b-capped 240 "${C[@]}" "$SRC4B" "$WORK/4b-q-capped" "${CAL[@]}" --max-memory "$CAP"
step validate 120 "$PY" -m mtpquant validate "$TINY" "$WORK/tiny-q" --device "$DEVICE" --json
rm -rf "$WORK/tiny-q-healed"
step heal 180 "$PY" -m mtpquant heal "$WORK/tiny-q" --from "$TINY" --out "$WORK/tiny-q-healed" --device "$DEVICE" \
  --force --json

"$PY" - "$WORK" "$CAP" <<'EOF'
import json, sys
from pathlib import Path
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.units import format_bytes
work = Path(sys.argv[1])
walls = {k: int(v) / 1000 for k, v in (line.split() for line in (work / "walls.txt").read_text().splitlines())}
print(f"{'step':<12} {'wall':>8} {'peak RSS':>10} {'peak GPU':>10}  notes")
for name in ("tiny", "tiny-capped", "4b", "4b-capped"):
    r = json.loads((work / f"{name}.json").read_text())
    notes = f"layer-wise, placement {r['placement']}" if r["layerwise"] else "in one pass"
    print(f"{name:<12} {walls[name]:>7.1f}s {format_bytes(r['peak_rss_bytes']):>10} "
          f"{format_bytes(r['peak_gpu_bytes']):>10}  {notes}; written {r['bytes_written'] / r['output_bytes']:.2f}x")
v = json.loads((work / "validate.json").read_text())
print(f"validate     {walls['validate']:>7.1f}s  verdict {v['verdict']['status']}: {v['verdict']['reasons'][0]}")
h = json.loads((work / "heal.json").read_text())
rows = ", ".join(f"k={r['k']} {r['before']:.3f} -> {r['after']:.3f} [{r['low']:+.3f}, {r['high']:+.3f}]"
                 for r in h["record"]["by_k"])
print(f"heal         {walls['heal']:>7.1f}s {format_bytes(h['peak_rss_bytes']):>10}  {h['action']}: {rows}")
a, b = Checkpoint.open(work / "4b-q", strict=True), Checkpoint.open(work / "4b-q-capped", strict=True)
same = sorted(a.tensors) == sorted(b.tensors) and all(a.read_raw(e) == b.read_raw(b.tensors[n]) for n, e in a.tensors.items())
print(f"4B in memory vs --max-memory {sys.argv[2]}: {'bit-identical' if same else 'DIFFERENT'} ({len(a.tensors)} tensors)")
sys.exit(0 if same else 1)
EOF
# Qwen3.8-Flash-Next (qwen4_exp): the trained tiny model converted on the GPU (MTP kept, and quantized through its
# MTP forward); with vLLM, both served with MTP (k = 1 and 3) and the engine's acceptance from /metrics put beside
# validate's built-in prediction (--compare-reference): the family's only engine measurement of acceptance.
TINY4=mtpquant/assets/tiny-qwen4_exp-mtp
step q4-keep 120 "${C[@]}" "$TINY4" "$WORK/q4-keep" "${CAL[@]}"
step q4-quantize 120 "$PY" -m mtpquant convert --mtp quantize --device "$DEVICE" --overwrite --json "$TINY4" \
  "$WORK/q4-quantize" "${CAL[@]}"
step q4-validate 300 "$PY" -m mtpquant validate "$TINY4" "$WORK/q4-quantize" --device "$DEVICE" --json
rm -rf "$WORK/q4-healed"
step q4-heal 300 "$PY" -m mtpquant heal "$WORK/q4-quantize" --from "$TINY4" --out "$WORK/q4-healed" \
  --device "$DEVICE" --force --json
TINYG=mtpquant/assets/tiny-glm4_moe-mtp
step glm-keep 120 "${C[@]}" "$TINYG" "$WORK/glm-keep" "${CAL[@]}"
step glm-quantize 120 "$PY" -m mtpquant convert --mtp quantize --device "$DEVICE" --overwrite --json "$TINYG" \
  "$WORK/glm-quantize" "${CAL[@]}"
TINYM=mtpquant/assets/tiny-qwen3_5_moe-mtp
BUDGET=0.05
step moe-keep 120 "${C[@]}" "$TINYM" "$WORK/moe-keep" "${CAL[@]}"
step moe-auto 600 "$PY" -m mtpquant convert --mtp auto --al-budget "$BUDGET" --device "$DEVICE" --overwrite --json \
  "$TINYM" "$WORK/moe-auto" "${CAL[@]}"
"$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
for name in ("q4-keep", "q4-quantize", "glm-keep", "glm-quantize", "moe-keep", "moe-auto"):
    r = json.loads((work / f"{name}.json").read_text())
    print(f"{name:<12} peak GPU {r['peak_gpu_bytes'] / 1e9:.2f} GB, verdict {r['verdicts']['vllm']}")
v = json.loads((work / "q4-validate.json").read_text())
print(f"q4-validate  verdict {v['verdict']['status']}: {v['verdict']['reasons'][0]}")
h = json.loads((work / "q4-heal.json").read_text())
rows = ", ".join(f"k={r['k']} {r['before']:.3f} -> {r['after']:.3f} [{r['low']:+.3f}, {r['high']:+.3f}]"
                 for r in h["record"]["by_k"])
print(f"q4-heal      {h['action']}: {rows}")
s = json.loads((work / "moe-auto" / "mtp_search" / "report.json").read_text())
chosen = s["evaluated"][s["chosen"]]
print(f"moe-auto     chose {chosen['assignment']}: {chosen['nbytes']} of the BF16 MTP's {s['bf16_bytes']} bytes")
EOF
if [[ -n "${GPU_CHECK_VLLM_PYTHON:-}" ]]; then
  for q in q4-keep q4-quantize q4-healed glm-keep glm-quantize; do
    REF=$TINY4
    [[ $q == glm-* ]] && REF=$TINYG
    # a verdict (0 pass, 17 warn, 18 fail) is a measurement to read below; any other exit is a broken check
    set +e
    timeout $(( 1200 * SCALE )) "$PY" -m mtpquant validate "$REF" "$WORK/$q" --engine vllm \
      --vllm-python "$GPU_CHECK_VLLM_PYTHON" --compare-reference --k 1,3 --num-prompts 16 --report-dir "$WORK/$q-served" \
      --json >"$WORK/$q-served.json" 2>"$WORK/$q-served.log"
    echo $? >"$WORK/$q-served.exit"
    set -e
  done
  "$PY" - "$WORK" <<'EOF3'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
bad = 0
print(f"{'tiny on vLLM':<18} {'side':<10} {'k':>2} {'engine AL':>9} {'predicted':>9}  agrees")
for name in ("q4-keep", "q4-quantize", "q4-healed", "glm-keep", "glm-quantize"):
    code = int((work / f"{name}-served.exit").read_text())
    if code not in (0, 17, 18):
        print(f"{name:<18} validate --engine vllm exited {code} (see {work / (name + '-served.log')})")
        bad += 1
        continue
    report = json.loads((work / f"{name}-served.json").read_text())
    for side, rows in (report.get("predicted_vs_engine") or {}).items():
        if not isinstance(rows, list):
            continue
        for r in rows:
            # the engine-test tolerance (tests/test_engine_validate.py): AL sums k per-position rates, each ~0.05
            ok = abs(r["difference"]) <= max(0.1, 0.05 * r["k"])
            bad += not ok
            print(f"{name:<18} {side:<10} {r['k']:>2} {r['engine_al']:>9.3f} {r['predicted_al']:>9.3f}  "
                  f"{'yes' if ok else 'NO'}")
# heal's gain as vLLM measures it: the healed quant's engine AL beside the unhealed one's (the same prompts)
served = {}
for name in ("q4-quantize", "q4-healed"):
    if (work / f"{name}-served.json").is_file() and int((work / f"{name}-served.exit").read_text()) in (0, 17, 18):
        rows = json.loads((work / f"{name}-served.json").read_text()).get("predicted_vs_engine", {}).get("candidate")
        served[name] = {r["k"]: r["engine_al"] for r in rows or []}
if len(served) == 2:
    for k in sorted(served["q4-quantize"]):
        before, after = served["q4-quantize"][k], served["q4-healed"].get(k, float("nan"))
        print(f"qwen4_exp heal on vLLM  k={k}: engine AL {before:.3f} (unhealed) -> {after:.3f} (healed), "
              f"{after - before:+.3f}")
sys.exit(1 if bad else 0)
EOF3
  # #38 on the MoE: the BF16 MTP (keep) and the chosen one (auto) served on the same prompts, the same target
  set +e  # a verdict (0, 17, 18) is a measurement; any other exit is a broken check
  timeout $(( 1200 * SCALE )) "$PY" -m mtpquant validate "$WORK/moe-keep" "$WORK/moe-auto" --engine vllm \
    --vllm-python "$GPU_CHECK_VLLM_PYTHON" --k 1,3 --num-prompts 32 --report-dir "$WORK/moe-served" --json \
    >"$WORK/moe-served.json" 2>"$WORK/moe-served.log"
  rc=$?
  set -e
  [[ $rc -eq 0 || $rc -eq 17 || $rc -eq 18 ]] || { echo "FAILED: moe-served exited $rc (see $WORK/moe-served.log)"; exit 1; }
  "$PY" - "$WORK" "$BUDGET" <<'EOF4'
import json, sys
from pathlib import Path
report = json.loads((Path(sys.argv[1]) / "moe-served.json").read_text())
budget = float(sys.argv[2])
al = {side: {r["k"]: r["mean_acceptance_length"] for r in report[side]["acceptance"]["by_k"]}
      for side in ("reference", "candidate")}
bad = 0
for k, bf16 in sorted(al["reference"].items()):
    auto = al["candidate"][k]
    ok = auto >= bf16 - (budget + 0.1)
    bad += not ok
    print(f"qwen3_5_moe --mtp auto on vLLM  k={k}: engine AL {bf16:.3f} (BF16 MTP) vs {auto:.3f} (chosen), "
          f"{auto - bf16:+.3f} {'within' if ok else 'NOT within'} the budget + 0.1")
sys.exit(1 if bad else 0)
EOF4
  Q4=()
  [[ -n "${GPU_CHECK_QWEN4_EXP:-}" ]] && Q4=(--checkpoint "$GPU_CHECK_QWEN4_EXP")
  timeout $(( 1800 * SCALE )) "$PY" scripts/qwen4_exp_serve_check.py --vllm-python "$GPU_CHECK_VLLM_PYTHON" \
    --work "$WORK/qwen4-exp" "${Q4[@]}"
  DS=()
  [[ -n "${GPU_CHECK_DEEPSEEK:-}" ]] && DS=(--checkpoint "$GPU_CHECK_DEEPSEEK")
  timeout $(( 1200 * SCALE )) "$PY" scripts/nextn_serve_check.py --vllm-python "$GPU_CHECK_VLLM_PYTHON" \
    --work "$WORK/nextn" "${DS[@]}"
fi

if [[ -n "${GPU_CHECK_SGLANG_PYTHON:-}" ]]; then
  SGL=$GPU_CHECK_SGLANG_PYTHON
  "$SGL" -c "import sglang; print('sglang', sglang.__version__)"
  declare -A VARIANTS=(
    [nvfp4-keep]="--mtp keep"
    [nvfp4-quantize]="--mtp quantize"
    [fp8-mtp]="--mtp quantize --mtp-format fp8"
    [ct-keep]="--mtp keep --format compressed-tensors"
    [ct-quantize]="--mtp quantize --format compressed-tensors"
  )
  for name in nvfp4-keep nvfp4-quantize fp8-mtp ct-keep ct-quantize; do
    # shellcheck disable=SC2086
    step "sgl-convert-$name" 90 "${C[@]}" "$TINY" "$WORK/sgl-$name" "${CAL[@]}" ${VARIANTS[$name]}
    "$PY" -m mtpquant inspect "$WORK/sgl-$name" --json >"$WORK/sgl-$name.inspect.json" || true
    set +e
    timeout 600 "$PY" -m mtpquant validate "$WORK/sgl-$name" --engine sglang --sglang-python "$SGL" --k 2,2 \
      --device "$DEVICE" --num-prompts 8 --max-len 96 --report-dir "$WORK/sgl-$name.report" --json \
      --engine-arg=--disable-cuda-graph >"$WORK/sgl-$name.validate.json" 2>"$WORK/sgl-$name.validate.log"
    echo $? >"$WORK/sgl-$name.exit"
    set -e
  done
  "$PY" - "$WORK" <<'EOF2'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
bad = 0
print(f"{'SGLang':<16} {'inspect says':<48} {'exit':>4} {'AL':>6}  agrees")
for name in ("nvfp4-keep", "nvfp4-quantize", "fp8-mtp", "ct-keep", "ct-quantize"):
    verdict = json.loads((work / f"sgl-{name}.inspect.json").read_text())["verdicts"]["sglang"]
    code = int((work / f"sgl-{name}.exit").read_text())
    al = None
    if code in (0, 17, 18):
        report = json.loads((work / f"sgl-{name}.validate.json").read_text())
        al = report["reference"]["acceptance"]["by_k"][0]["mean_acceptance_length"]
    if verdict.startswith("SGLang: MTP loads"):
        agrees = al is not None and al > 1.3
    elif "will fail to load" in verdict:
        agrees = code == 44
    else:  # a wrong MTP: it loads, and drafts badly
        agrees = al is not None and al < 1.3
    bad += not agrees
    print(f"{name:<16} {verdict[:48]:<48} {code:>4} {al if al is None else round(al, 3)!s:>6}  {'yes' if agrees else 'NO'}")
sys.exit(1 if bad else 0)
EOF2
else
  echo "NVFP4 + SGLang: skipped (set GPU_CHECK_SGLANG_PYTHON to the python of an SGLang GPU environment)"
fi
# GPU_CHECK_TRTLLM_SERVE defaults to the trtllm-serve on PATH; without one the step is skipped
GPU_CHECK_TRTLLM_SERVE=${GPU_CHECK_TRTLLM_SERVE:-$(command -v trtllm-serve || true)}
if [[ -n "$GPU_CHECK_TRTLLM_SERVE" ]]; then
  TRT=$GPU_CHECK_TRTLLM_SERVE
  TRT_PORT=${GPU_CHECK_TRTLLM_PORT:-8391}
  # the tiny model's NVFP4 quant with its MTP kept (BF16, step 2) and quantized (NVFP4, TensorRT-LLM's names of the
  # BF16 glue excluded)
  step trt-quantize 60 "$PY" -m mtpquant convert --mtp quantize --device "$DEVICE" --overwrite --json "$TINY" \
    "$WORK/tiny-q-quantize" "${CAL[@]}"
  printf 'speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 2}\n' >"$WORK/trt-mtp.yaml"
  trt_failed=0
  for OUT in "$WORK/tiny-q" "$WORK/tiny-q-quantize"; do
    name=$(basename "$OUT")
    "$PY" -m mtpquant inspect "$OUT" --json >"$WORK/trt.$name.inspect.json" || true
    set +e
    $TRT "$OUT" --host 127.0.0.1 --port "$TRT_PORT" --extra_llm_api_options "$WORK/trt-mtp.yaml" \
      >"$WORK/trt.$name.serve.log" 2>&1 &
    TRT_PID=$!
    up=0
    for _ in $(seq 1 300); do
      if curl -fs "http://127.0.0.1:$TRT_PORT/health" >/dev/null 2>&1; then up=1; break; fi
      kill -0 "$TRT_PID" 2>/dev/null || break
      sleep 1
    done
    code=44
    if [[ $up == 1 ]]; then
      timeout 300 "$PY" -m mtpquant validate "$TINY" --server "http://127.0.0.1:$TRT_PORT" --num-prompts 8 \
        --max-len 96 --report-dir "$WORK/trt.$name.report" --json >"$WORK/trt.$name.validate.json" \
        2>"$WORK/trt.$name.validate.log"
      code=$?
    fi
    kill "$TRT_PID" 2>/dev/null; wait "$TRT_PID" 2>/dev/null
    set -e
    "$PY" - "$WORK" "$name" "$code" <<'EOF3' || trt_failed=1
import json, sys
from pathlib import Path
work, name, code = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
verdict = json.loads((work / f"trt.{name}.inspect.json").read_text())["verdicts"]["trtllm"]
al = None
if code == 0:
    report = json.loads((work / f"trt.{name}.validate.json").read_text())
    al = report["reference"]["acceptance"]["by_k"][0]["mean_acceptance_length"]
agrees = (al is not None and al > 1.3) if verdict.startswith("TensorRT-LLM: MTP loads") else code != 0
print(f"TensorRT-LLM  {name}  inspect: {verdict[:80]}  exit {code}  AL {al}  agrees: {'yes' if agrees else 'NO'}")
sys.exit(0 if agrees else 1)
EOF3
  done
  [[ $trt_failed == 0 ]] || { echo "FAILED: TensorRT-LLM disagrees with inspect's verdict"; exit 1; }
else
  echo "NVFP4 + TensorRT-LLM: skipped (no trtllm-serve on PATH; or set GPU_CHECK_TRTLLM_SERVE to the trtllm-serve of a TensorRT-LLM GPU environment)"
fi
echo "gpu check: $(( $(date +%s) - T0 )) s in all"
