#!/usr/bin/env bash
# Fashion-MNIST (Xiao et al. 2017: 70,000 real 28x28 grey images of clothing, 10 classes) -> WebDataset
# shards in OUTDIR: train-0000{00..59}.tar (60,000 images) and test-0000{00..09}.tar (10,000), 1,000
# per shard, each split with its manifest; and OUTDIR_mosaic (beside OUTDIR: a conversion never writes
# inside the shards it reads): 2x2 mosaics (56 px) of the first 5,000 training images and of the first
# 4,000 test images (1,250 and 1,000 mosaics), whose masks give each tile's class where the garment is
# (grey level 32 or more) and a background class elsewhere: the study's dense task. The four IDX files are read from $FASHION_MNIST, else from
# Debian's package (apt-get install dataset-fashion-mnist: /usr/share/datasets/fashion-mnist), gzipped
# or not. A split whose manifest exists already is kept.
#   usage: data/fashion_mnist.sh OUTDIR [SSL_VIT]
set -euo pipefail
out=${1:?usage: data/fashion_mnist.sh OUTDIR [SSL_VIT]}
sslvit=${2:-ssl-vit}
dir=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}

find_idx() {  # the IDX file $1 in $dir, gzipped or not
  for name in "$1.gz" "$1"; do
    if [ -f "$dir/$name" ]; then echo "$dir/$name"; return; fi
  done
  echo "Fashion-MNIST not found: $dir has no $1(.gz); install it (sudo apt-get install dataset-fashion-mnist) or set FASHION_MNIST=DIR to a folder holding the four IDX files" >&2
  exit 1
}

for split in train t10k; do
  images=$(find_idx "$split-images-idx3-ubyte")
  labels=$(find_idx "$split-labels-idx1-ubyte")
  name=$([ "$split" = t10k ] && echo test || echo train)
  if [ ! -f "$out/$name.json" ]; then
    "$sslvit" data convert "idx:$images,$labels" "$out" --split "$name" --shard-size 1000
  fi
done

mosaics=${out%/}_mosaic
for split in train:5 test:4; do  # the first 5 training shards (5,000 images), the first 4 test shards
  name=${split%:*}
  if [ ! -f "$mosaics/$name.json" ]; then
    shards=$(find "$out" -maxdepth 1 -name "$name-*.tar" | wc -l)
    wanted=${split#*:}
    last=$(printf %06d $(( (shards < wanted ? shards : wanted) - 1 )))
    "$sslvit" data convert "mosaic:$out/$name-{000000..$last}.tar" "$mosaics" --split "$name" \
      --grid 2 --background-threshold 32 --shard-size 250
  fi
done
