#!/bin/bash
# The study's SimMIM pretrained on the stream of shard segments against make study's own runs (the
# epoch's global order), on one host: the same recipe, seeds and shards, gzip-compressed so that the
# stream cannot index them and reads them as segments with a shuffle buffer (ssl_vit/data/stream/
# epoch_order.py `indexable`). Then `ssl-vit compare` of the two on the study's suite, the segment
# stream the baseline: each column's paired difference with its 95% interval.
#
#     make study && bash benchmarks/stream_ab.sh [OUT]      (about 35 min on 2 cores)
set -euo pipefail
OUT=${1:-runs/stream_ab}
SSLVIT=${SSLVIT:-.venv/bin/ssl-vit}
SHARDS=data/shards/fashion_mnist
mkdir -p "$OUT/shards"
for f in "$SHARDS"/train-*.tar; do
  [ -f "$OUT/shards/$(basename "$f")" ] || gzip -c "$f" > "$OUT/shards/$(basename "$f")"
done
cp "$SHARDS"/*.json "$OUT/shards/"
for seed in 0 1; do
  OMP_NUM_THREADS=1 $SSLVIT fit --config recipes/study/simmim.yaml --seed_everything $seed \
    --data.init_args.seed $seed --data.init_args.train_urls "$OUT/shards/train-{000000..000059}.tar" \
    --trainer.default_root_dir "$OUT/simmim_segments_$seed" --ckpt_path last > "$OUT/simmim_segments_$seed.log" 2>&1 &
done
wait
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 --no-python $SSLVIT compare \
  simmim_segments="$OUT/simmim_segments_0/checkpoints/last.ckpt,$OUT/simmim_segments_1/checkpoints/last.ckpt" \
  simmim_global=runs/study/simmim_0/checkpoints/last.ckpt,runs/study/simmim_1/checkpoints/last.ckpt \
  --baseline simmim_segments --suite recipes/study/eval.yaml --out "$OUT/compare" --overwrite
