#!/usr/bin/env bash
# The GPU figures of docs/results/speed.md in one go (its steps are limited to 580 s together): the CUDA
# tests, where a local step's time goes (fedlt bench profile), every backend against the peer-style
# loop and the limit of one model at batch K x B (fedlt bench speed --backends), and what a round of
# each paper's own method costs (fedlt bench paper-rounds). All on synthetic CIFAR-shaped data (3 x 32 x 32),
# so no dataset files are needed. Each step writes its table to OUT_DIR as soon as it ends.
#
#   scripts/gpu_speed.sh OUT_DIR            (run from the repository root; PYTHON=... picks the interpreter)
set -uo pipefail
out="${1:?usage: scripts/gpu_speed.sh OUT_DIR}"
mkdir -p "$out"
export FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
data=(data.dataset=synthetic data.image_size=32 run.device=cuda)
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log, never stop the script
  local name=$1 limit=$2; shift 2
  echo "== $name (at most ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}"
}
fedlt=("$py" -m fedlt.cli)

"$py" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))" | tee "$out/device.txt"
step tests 110 "$py" -m pytest -v -p no:cacheprovider tests/test_gpu.py  # -v: a cut-off step still names what ran
step profile 110 "${fedlt[@]}" bench profile --models resnet8,resnet32 --sampled 10,40 --synthetic-size 32 \
  --backends sequential,vectorized,graphed --out "$out/profile.md" "${data[@]}"
step backends 230 "${fedlt[@]}" bench speed --backends --rounds 1 --no-k-table --models cnn,resnet8,resnet32,resnet18 \
  --sampled 10,40 --synthetic-size 32 --out "$out/backends.md" "${data[@]}" run.channels_last=false
step paper-rounds 130 "${fedlt[@]}" bench paper-rounds paper-creff paper-fedloge paper-sfd paper-gbme paper-fedyoyo \
  --row paper-creff:CReFF --row paper-fedloge:FedLoGe --row paper-sfd:SFD --row paper-gbme:GBME \
  --row paper-fedyoyo:FedYoYo --backends sequential,graphed --out "$out/paper-rounds.md" run.device=cuda
