"""Evaluation of checkpoints by the protocols of a suite; the reports and `compare` are `ssl_vit.report`'s.

- `suite_file`, `suite`: what a suite file may hold, and its run on one checkpoint (`evaluate`);
- `ranks`: `ssl-vit compare` under torchrun, the checkpoints dealt out to the ranks;
- `protocol`: what a protocol kind is, and its registry; the kinds themselves are in `kinds/`;
- `features`, `cache`: frozen features of an exact pass, once per split for every protocol that reads them;
- `fewshot`, `knn`: the closed-form few-shot probe and weighted k-NN on those features;
- `trained`: what the trained protocols share (probes, fine-tuning): their keys, labelled images, the
  task they train;
- `scoring`, `selection`, `scorable`, `segmentation`, `stats`: per-image statistics, choosing a candidate
  on held-out images, whether a question can be answered, mIoU, and the bootstrap intervals;
- `monitor`: the few-shot probe as a live signal during pretraining (`FewShotMonitor`).
"""
