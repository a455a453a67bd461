#!/usr/bin/env bash
# The follow-up of the quality comparison's reversed columns (RESULTS.md, "Following up the reversed
# columns"), from the repository root after `make peers` (seeds 0 and 1), once these extra runs exist
# (each python the one of .venv-peers):
#   python benchmarks/peers/init_ablation.py --methods mae --inits mae --target pixels --seeds 0 1 \
#       --no-compare --out runs/peers/target
#   python benchmarks/peers/init_ablation.py --methods mae --inits mae --target seen_pixels \
#       --seeds 0 1 2 --no-compare --out runs/peers/target
#   python benchmarks/peers/init_ablation.py --methods simmim --inits timm --target seen_pixels \
#       --head xavier --seeds 0 1 2 --no-compare --out runs/peers/head
#   python benchmarks/peers/init_ablation.py --methods simmim --inits timm --target seen_pixels \
#       --head torch --seeds 0 1 2 --no-compare --out runs/peers/head
#   make study-pretrain STUDY_METHODS=mae STUDY_SEEDS=2
#   make study-pretrain STUDY_METHODS=simmim STUDY_SEEDS="0 1 2" STUDY=runs/study_xavier_head \
#       STUDY_FIT_ARGS="--model.init_args.head_init xavier"
#   python benchmarks/peers/quality.py --peers adapter_lightly --methods mae --seeds 2 3 4 5 --no-compare
#   python benchmarks/peers/quality.py --peers adapter_stable_pretraining --methods simmim \
#       --seeds 2 3 4 5 --no-compare
# Then this: `ssl-vit compare` of them on 2 ranks, verdicts on followup_claims.yaml, into
# runs/peers/followup. Seeds 3 to 5 of each peer are a second set of runs of the same implementation:
# what the verdicts make of two sets of seeds of one thing. The rows `simmim` and
# `ssl-vit_timm_seen_pixels_simmim` are ssl-vit's SimMIM as it was measured then, its head started
# xavier-uniform (the preset's `head_init: torch` came of this follow-up).
set -e
B=.venv-peers/bin
S=runs/study; X=runs/study_xavier_head; Q=runs/peers/quality; T=runs/peers/target; H=runs/peers/head
runs() {  # runs NAME DIR PATTERN SEED... -> NAME=DIR/PATTERN(seed),... (PATTERN's % is the seed)
  local name=$1 dir=$2 pattern=$3 out=""; shift 3
  for seed in "$@"; do out+="${out:+,}$dir/${pattern//%/$seed}"; done
  echo "$name=$out"
}
OMP_NUM_THREADS=1 $B/torchrun --nproc-per-node 2 --no-python $B/ssl-vit compare \
  "$(runs mae $S mae_%/checkpoints/last.ckpt 0 1 2)" \
  "$(runs ssl-vit_mae_pixels_mae $T mae_pixels_mae_%/encoder.safetensors 0 1)" \
  "$(runs ssl-vit_mae_seen_pixels_mae $T mae_seen_pixels_mae_%/encoder.safetensors 0 1 2)" \
  "$(runs lightly_mae $Q lightly_mae_%/encoder.safetensors 0 1 2)" \
  "$(runs lightly_mae_again $Q lightly_mae_%/encoder.safetensors 3 4 5)" \
  "$(runs simmim $X simmim_%/checkpoints/last.ckpt 0 1 2)" \
  "$(runs ssl-vit_timm_seen_pixels_simmim $H timm_seen_pixels_xavier_head_simmim_%/encoder.safetensors 0 1 2)" \
  "$(runs ssl-vit_timm_seen_pixels_torch_head_simmim $H timm_seen_pixels_torch_head_simmim_%/encoder.safetensors 0 1 2)" \
  "$(runs stable-pretraining_simmim $Q stable-pretraining_simmim_%/encoder.safetensors 0 1 2)" \
  "$(runs stable-pretraining_simmim_again $Q stable-pretraining_simmim_%/encoder.safetensors 3 4 5)" \
  --suite $Q/suite.yaml --claims benchmarks/peers/followup_claims.yaml --out runs/peers/followup --overwrite
