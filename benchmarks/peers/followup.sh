#!/usr/bin/env bash
# The follow-up of the quality comparison's reversed columns (RESULTS.md, "Following up the reversed
# columns"), from the repository root after `make peers`, once the extra runs exist:
#   python benchmarks/peers/init_ablation.py --methods mae --inits mae --target pixels --seeds 0 1 \
#       --no-compare --out runs/peers/target
#   python benchmarks/peers/init_ablation.py --methods simmim --inits timm --target seen_pixels \
#       --seeds 0 1 2 --no-compare --out runs/peers/target
#   make study-pretrain STUDY_METHODS=simmim STUDY_SEEDS=2
#   python benchmarks/peers/quality.py --peers adapter_stable_pretraining --methods simmim --seeds 2 --no-compare
# (each python the one of .venv-peers, with OMP_NUM_THREADS=1). Then this: `ssl-vit compare` of them on
# 2 ranks, verdicts on followup_claims.yaml, into runs/peers/followup.
set -e
B=.venv-peers/bin
S=runs/study; Q=runs/peers/quality; T=runs/peers/target
OMP_NUM_THREADS=1 $B/torchrun --nproc-per-node 2 --no-python $B/ssl-vit compare \
  mae=$S/mae_0/checkpoints/last.ckpt,$S/mae_1/checkpoints/last.ckpt \
  ssl-vit_mae_pixels_mae=$T/mae_pixels_mae_0/encoder.safetensors,$T/mae_pixels_mae_1/encoder.safetensors \
  lightly_mae=$Q/lightly_mae_0/encoder.safetensors,$Q/lightly_mae_1/encoder.safetensors \
  simmim=$S/simmim_0/checkpoints/last.ckpt,$S/simmim_1/checkpoints/last.ckpt,$S/simmim_2/checkpoints/last.ckpt \
  stable-pretraining_simmim=$Q/stable-pretraining_simmim_0/encoder.safetensors,$Q/stable-pretraining_simmim_1/encoder.safetensors,$Q/stable-pretraining_simmim_2/encoder.safetensors \
  ssl-vit_timm_seen_pixels_simmim=$T/timm_seen_pixels_simmim_0/encoder.safetensors,$T/timm_seen_pixels_simmim_1/encoder.safetensors,$T/timm_seen_pixels_simmim_2/encoder.safetensors \
  --suite $Q/suite.yaml --claims benchmarks/peers/followup_claims.yaml --out runs/peers/followup --overwrite
