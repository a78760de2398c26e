#!/usr/bin/env bash
# The GPU figures of docs/results/speed.md: the CUDA tests, every backend against the peer-style loop and
# the limit of one model at batch K x B (fedlt bench speed --backends), where a local step's time goes
# (fedlt bench profile), what a round of each paper's own method costs (fedlt bench paper-rounds), and
# where the host's time per client goes besides its steps (scripts/client_host_work.py --profile), with the
# GPU's own paths and with the CPU's (--as-on=gpu, --as-on=cpu: a reply packed or not, on one machine).
# All on synthetic CIFAR-shaped data (3 x 32 x 32), so no dataset files are needed. The backends and the
# profile train clients of the papers' size: the 3,000 balanced synthetic images split IID over the
# sampled clients (300 images, 20 steps of batch 32 a round with 10 clients; 75 images, 6 steps with 40),
# 2 local epochs; 2 timed rounds a row (one round on a fresh machine moved sequential training by up to
# 1.6x between runs). The paper rounds train on synthetic data of each setting's CIFAR size (fedlt
# bench paper-rounds). Each step writes its table to OUT_DIR as soon as it ends.
#
#   scripts/gpu_speed.sh OUT_DIR [STEP[=SECONDS] ...]
#       STEP: tests, backends, profile, paper-rounds, host-work (default: all, at most 1,020 s together); =SECONDS
#       replaces a step's time limit (e.g. paper-rounds=500). Run from
#       the repository root; PYTHON=... picks the interpreter; SRC=DIR times another version's package
#       (e.g. `git archive OLD src | tar -x -C DIR/..`), to compare two versions on one machine.
#       MODELS=resnet8,resnet32 narrows the backends step to those models, PAPERS="gbme fedyoyo" the
#       paper-rounds step to those methods: a short device lease measures what is still missing.
set -uo pipefail
out="${1:?usage: scripts/gpu_speed.sh OUT_DIR [STEP[=SECONDS] ...]}"
shift
declare -A limits=()
for arg in "${@:-tests backends profile paper-rounds host-work}"; do
  for asked in $arg; do
    name=${asked%%=*}
    case $name in tests|backends|profile|paper-rounds|host-work) ;;
      *) echo "unknown step '$name': use tests, backends, profile, paper-rounds or host-work" >&2; exit 2;; esac
    limits[$name]=$([[ $asked == *=* ]] && echo "${asked#*=}" || echo default)
    [[ ${limits[$name]} == default || ${limits[$name]} =~ ^[1-9][0-9]*$ ]] \
      || { echo "step $asked: give its time limit in whole seconds, e.g. $name=300" >&2; exit 2; }
  done
done
mkdir -p "$out"
export FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1 PYTHONPATH="${SRC:-$PWD/src}${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
clients=(data.dataset=synthetic data.image_size=32 data.partition=iid data.imbalance_factor=1 data.num_clients=10
         fl.local_epochs=2 run.device=cuda run.channels_last=false)
step() {  # step NAME SECONDS COMMAND...: run when asked for, with a time limit, log to OUT_DIR/NAME.log
  local name=$1 limit=$2; shift 2
  [[ -n ${limits[$name]:-} ]] || return 0
  [[ ${limits[$name]} == default ]] || limit=${limits[$name]}
  echo "== $name (at most ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}"
}
fedlt=("$py" -m fedlt.cli)
models="${MODELS:-resnet8,resnet32,resnet18,cnn}"
declare -A paper_rows=([creff]=CReFF [fedloge]=FedLoGe [sfd]=SFD [gbme]=GBME [fedyoyo]=FedYoYo)
papers=() rows=()
for paper in ${PAPERS:-creff fedloge sfd gbme fedyoyo}; do
  [[ -n ${paper_rows[$paper]:-} ]] || { echo "PAPERS: unknown method '$paper': use creff, fedloge, sfd, gbme or fedyoyo" >&2; exit 2; }
  papers+=("paper-$paper") rows+=(--row "paper-$paper:${paper_rows[$paper]}")
done

"$py" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))" | tee "$out/device.txt"
step tests 150 "$py" -m pytest -v -p no:cacheprovider tests/test_gpu.py  # -v: a cut-off step still names what ran
step backends 250 "${fedlt[@]}" bench speed --backends --rounds 2 --no-k-table --models "$models" \
  --sampled 10,40 --synthetic-size 32 --compare sequential,graphed --out "$out/backends.md" "${clients[@]}"
step profile 100 "${fedlt[@]}" bench profile --models resnet8,resnet32 --sampled 10 --synthetic-size 32 \
  --backends sequential,graphed --out "$out/profile.md" "${clients[@]}"
step paper-rounds 400 "${fedlt[@]}" bench paper-rounds "${papers[@]}" "${rows[@]}" --backends sequential,graphed \
  --out "$out/paper-rounds.md" run.device=cuda
step host-work 120 bash -c 'for model in resnet8 resnet32; do for paths in gpu cpu; do
  "$0" scripts/client_host_work.py 40 --profile --as-on=$paths model.name=$model run.device=cuda \
    run.channels_last=false || exit; done; done' "$py"
