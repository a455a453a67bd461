#!/usr/bin/env bash
# One GPU, ViT-B/16 at 224 px, bf16: supervised and MAE training steps against a plain timm loop,
# torch.compile off, then per transformer block, then of the whole step as CUDA graphs
# (`--compile-scope step --compile-mode reduce-overhead`); images/s, MFU and the MAE / supervised
# ratios, as tables. The third table's heading counts the compiled graphs that ran without CUDA
# graphs, if any (inductor's "skipping cudagraphs due to ..." warning above it says why). Next, MAE's
# eager step piece by piece (`ssl-vit bench parts`): encoder blocks, decoder blocks and the rest, each
# with its FLOP rate against supervised's blocks. Then the input path (`ssl-vit bench feed`): ImageNet's
# typical 500x375 JPEGs streamed from shards by 4, 8 and 16 DataLoader workers to normalised batches on
# the GPU, and decoded on the GPU (`--decode device`) with 2 and 4 workers, each against the supervised
# and MAE step rates of the first table, eager and compiled ("feed / step" above 1: the GPU never waits
# for data; DECODE_DEVICE=0 leaves the device decoding out).
#   bash benchmarks/gpu.sh   (about 5 min on an H200, compilation included, and about 1 more for the feed
#                            rows; WHOLE_STEP=0: 2 min and that)
# Goal on an H200: supervised >= 40% MFU (about 3,750 img/s), MAE >= 1.6x that.
# TASKS names the tasks of the step tables (default "supervised mae"; `bench parts` stays MAE's), e.g. the
# latent-target presets against supervised and MAE (batch 128: data2vec 2.0 runs 16 masked views of each
# image, 2,048 a step; about 5 min, an estimate, not yet run):
#   TASKS="supervised mae maskfeat ijepa data2vec2" BATCH=128 WHOLE_STEP=0 bash benchmarks/gpu.sh
# The defaults can be overridden for a quick look, e.g. VARIANT=Ti/16 BATCH=8 DEVICE=cpu ROUNDS=1; DEPTH=2
# builds every encoder and decoder 2 blocks deep (compiling a whole step at full depth takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
SSLVIT=${SSLVIT:-.venv/bin/ssl-vit}
JSON=${JSON:-benchmarks/gpu.json}
model=(--variant "${VARIANT:-B/16}" --img-size "${IMG_SIZE:-224}" --batch-size "${BATCH:-256}")
if [ -n "${DEPTH:-}" ]; then model+=(--depth "$DEPTH"); fi
common=(
    "${model[@]}"
    --precision "${PRECISION:-bf16-mixed}"
    --device "${DEVICE:-cuda}" --rounds "${ROUNDS:-3}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}"
)
read -r -a tasks <<< "${TASKS:-supervised mae}"
options=("${common[@]}" --tasks "${tasks[@]}")
written=("$JSON")
$SSLVIT bench step "${options[@]}" --compile both --json "$JSON" --overwrite
if [ "${WHOLE_STEP:-1}" = 1 ]; then
    $SSLVIT bench step "${options[@]}" --compile on --compile-scope step --compile-mode reduce-overhead \
        --json "${JSON%.json}-step.json" --overwrite
    written+=("${JSON%.json}-step.json")
fi
$SSLVIT bench parts "${common[@]}" --task mae --json "${JSON%.json}-parts.json" --overwrite
written+=("${JSON%.json}-parts.json")
feed=(
    "${model[@]}"
    --device "${DEVICE:-cuda}" --stored "${STORED:-500x375}" --batches "${FEED_BATCHES:-4}" --step-json "$JSON"
)
$SSLVIT bench feed "${feed[@]}" --workers "${FEED_WORKERS:-4,8,16}" --json "${JSON%.json}-feed.json" --overwrite
written+=("${JSON%.json}-feed.json")
if [ "${DECODE_DEVICE:-1}" = 1 ]; then
    $SSLVIT bench feed "${feed[@]}" --decode device --workers "${DEVICE_WORKERS:-2,4}" \
        --json "${JSON%.json}-feed-device.json" --overwrite
    written+=("${JSON%.json}-feed-device.json")
fi
echo "tables above; numbers in ${written[*]}"
