#!/usr/bin/env bash
# GPU check for issue 3 (run on 2 GPUs, e.g. the nvidia-h200-x2 device): a DeepSpeed ZeRO-3
# fine-tune of the demo coder variant with the MonoSoup callback firing, the end-of-run
# consolidation + BitDelta export, then the server on the GPU answering the OpenAI client.
# Expects data/ and models/base/ from `make data base`; writes logs and results to ${OUT:-outputs/gpu}.
set -euo pipefail
OUT=${OUT:-outputs/gpu}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus.csv"
python3 train/run.py variant=coder trainer=deepspeed_zero3 trainer.devices=2 trainer.max_steps=${STEPS:-80} \
  merge=monosoup merge.every_n_steps=20 variant.val_check_interval=10 logger=csv \
  checkpoint.every_n_steps=40 hydra.run.dir=outputs/gpu_zero3 2>&1 | tee "$OUT/train.log" | grep -E "^\[|Error" || true
test -f artifacts/coder/bitdelta.json
cp outputs/gpu_zero3/metrics.json "$OUT/metrics.json"
find outputs/gpu_zero3 -name metrics.csv -exec cp {} "$OUT/train_metrics.csv" \;
python3 serve/run.py device=cuda port=8765 > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf 127.0.0.1:8765/health >/dev/null && break; sleep 0.5; done
python3 - "$OUT/client.json" <<'PY'
import json, sys
from openai import OpenAI
c = OpenAI(base_url="http://127.0.0.1:8765/v1", api_key="unused")
ids = [m.id for m in c.models.list().data]
out = {"models": ids, "completions": {}}
for m in ids:
    r = c.completions.create(model=m, prompt="def parse_args(", max_tokens=24, temperature=0)
    out["completions"][m] = {"text": r.choices[0].text, "usage": r.usage.model_dump()}
json.dump(out, open(sys.argv[1], "w"), indent=2)
print(json.dumps(out, indent=2))
PY
