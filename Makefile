# ssl-vit: the README's commands. Everything runs inside .venv, created here with pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

CONSTRAINTS := requirements/constraints.txt

.PHONY: install constraints test quickstart study study-pretrain study-compare peers lint clean

install: $(STAMP)

# pyproject.toml declares the ranges ssl-vit works with (what `pip install` beside a cluster's torch
# gets); .venv gets the exact versions of $(CONSTRAINTS), the ones the tests and the study ran with.
# Reinstall whenever either changes.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

# Rewrites $(CONSTRAINTS) from what .venv holds now: after a new dependency in pyproject.toml, or after
# `.venv/bin/pip install NAME==VERSION` of a newer release that `make test` then passed with.
constraints: $(STAMP)
	$(PY) requirements/freeze.py > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

# Two test processes (pytest-xdist), each given whole files: about half the suite waits on one core
# (single-threaded commands, servers, timeouts) while the other idles. TEST_JOBS=0: pytest alone.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=25 $(PYTEST_ARGS)

SSLVIT := $(VENV)/bin/ssl-vit
SHARDS := data/shards/digits
RUNS := runs/quickstart

# digits -> shards -> ViT-paper masked patch prediction, MAE and supervised pretraining (digits 0-4
# only), tiny ViT on the CPU -> the comparison of the three and three scratch initialisations, with 95%
# intervals and each against scratch (few-shot on all and on held-out digits 5-9, k-NN, linear probe)
# -> the ViT paper's look inside MPP and supervised (attention distance, embeddings, rollout, MPP
# predictions) on 256 validation digits, seconds each. Each run writes config.yaml, checkpoints/,
# pictures/ (the masked tasks) and an offline W&B run under $(RUNS)/NAME; a rerun starts those runs afresh.
quickstart: $(STAMP)
	test -f $(SHARDS)/train.json || $(SSLVIT) data convert digits $(SHARDS) --split train --shard-size 300
	test -f $(SHARDS)/val.json || $(SSLVIT) data convert digits $(SHARDS) --split val --shard-size 100
	$(SSLVIT) data inspect '$(SHARDS)/val-{000000..000003}.tar'
	rm -rf $(RUNS)
	$(SSLVIT) fit --config recipes/quickstart/mpp.yaml --trainer.default_root_dir $(RUNS)/mpp
	$(SSLVIT) fit --config recipes/quickstart/mae.yaml --trainer.default_root_dir $(RUNS)/mae
	$(SSLVIT) fit --config recipes/quickstart/supervised.yaml --trainer.default_root_dir $(RUNS)/supervised
	$(SSLVIT) compare mpp=$(RUNS)/mpp/checkpoints/last.ckpt mae=$(RUNS)/mae/checkpoints/last.ckpt \
		supervised=$(RUNS)/supervised/checkpoints/last.ckpt --scratch 3 --baseline scratch \
		--suite recipes/eval/quickstart.yaml --out $(RUNS)/compare
	$(SSLVIT) analyze $(RUNS)/mpp/checkpoints/last.ckpt --data '$(SHARDS)/val-{000000..000003}.tar' --out $(RUNS)/analysis/mpp
	$(SSLVIT) analyze $(RUNS)/supervised/checkpoints/last.ckpt --data '$(SHARDS)/val-{000000..000003}.tar' \
		--out $(RUNS)/analysis/supervised
	@echo
	@echo "checkpoints:  $(RUNS)/{mpp,mae,supervised}/checkpoints/last.ckpt"
	@echo "W&B (offline): $(RUNS)/*/wandb  (look: $(VENV)/bin/wandb leet $(RUNS)/mpp/wandb; upload: wandb sync)"
	@echo "pictures:     $(RUNS)/mpp/pictures/  $(RUNS)/mae/pictures/"
	@echo "comparison:   $(RUNS)/compare/results.md  $(RUNS)/compare/fewshot.png  $(RUNS)/compare/bars.png"
	@echo "              $(RUNS)/compare/attention_distance.png"
	@echo "inside:       $(RUNS)/analysis/mpp/  $(RUNS)/analysis/supervised/  (PNGs, analysis.json)"

# The study: Fashion-MNIST (Debian's dataset-fashion-mnist, or FASHION_MNIST=DIR) -> shards -> ViT-paper
# MPP, MAE and SimMIM on all 60,000 training images without labels and supervised on the labels of
# classes 0-4, each at one equal budget (1,200 steps of 64 images, recipes/study/trainer.yaml) from two
# seeds -> `compare` against two scratch initialisations: few-shot on all, seen (0-4) and unseen (5-9)
# classes, k-NN and the linear probe (lr chosen on held-out training images), each on the [class] token
# and on the mean patch token, the attentive probe on all tokens, a linear segmentation probe on 2x2
# mosaics, and fine-tuning on 1% and 10% of the labels (lr chosen on held-out images) -> results.md,
# training_curves.png and the verdict on each claim (recipes/study/claims.yaml) in verdicts.md. The pretraining runs go two at a
# time, one thread each (faster on 2 cores than one after the other with two threads), and so do the
# checkpoints of the comparison (torchrun, two processes: the same table as one process); each run logs
# to $(STUDY)/NAME.log, and a rerun resumes or skips the runs already done. `make study DEVICE=gpu`: the same
# study with a larger ViT and more steps on one GPU (recipes/study/gpu.yaml, eval_gpu.yaml), in runs/study_gpu.
# The latent-target methods at the same budget: `make study STUDY_METHODS="mae maskfeat ijepa data2vec2"
# STUDY_CLAIMS= STUDY=runs/study_latent` (the paper's claims name the default methods; without them the
# verdicts are each method against scratch).
DEVICE ?= cpu
STUDY_GPU := $(filter gpu,$(DEVICE))
STUDY := runs/study$(if $(STUDY_GPU),_gpu)
STUDY_SHARDS := data/shards/fashion_mnist
STUDY_METHODS ?= mpp mae simmim supervised
STUDY_SEEDS ?= 0 1
STUDY_CLAIMS ?= recipes/study/claims.yaml
STUDY_RUNS := $(foreach seed,$(STUDY_SEEDS),$(STUDY_METHODS:%=%_$(seed)))
STUDY_JOBS := $(if $(STUDY_GPU),1,2)
STUDY_ENV := $(if $(STUDY_GPU),,OMP_NUM_THREADS=1)
STUDY_FIT_ARGS := $(if $(STUDY_GPU),--config recipes/study/gpu.yaml)
STUDY_SUITE := recipes/study/eval$(if $(STUDY_GPU),_gpu).yaml
study_ckpts = $(foreach run,$(filter $(1)_%,$(STUDY_RUNS)),$(STUDY)/$(run)/checkpoints/last.ckpt)
study_group = $(1)=$(subst $(eval) ,$(comma),$(call study_ckpts,$(1)))
comma := ,

study: $(STAMP)
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory study-pretrain && $(MAKE) --no-print-directory study-compare && \
	echo "study: $$(( ($$(date +%s) - start) / 60 )) min $$(( ($$(date +%s) - start) % 60 )) s from shards to verdicts"

study-pretrain: $(STAMP)
	bash data/fashion_mnist.sh $(STUDY_SHARDS) $(SSLVIT)
	$(MAKE) --no-print-directory -j$(STUDY_JOBS) $(STUDY_RUNS:%=$(STUDY)/%/pretrained)

$(STUDY)/%/pretrained:
	@mkdir -p $(STUDY)
	@echo "pretraining $* ($(STUDY)/$*.log)"
	@seed=$(lastword $(subst _, ,$*)); \
	$(STUDY_ENV) $(SSLVIT) fit --config recipes/study/$(firstword $(subst _, ,$*)).yaml $(STUDY_FIT_ARGS) \
		--seed_everything $$seed --data.init_args.seed $$seed --trainer.default_root_dir $(STUDY)/$* \
		--ckpt_path last > $(STUDY)/$*.log 2>&1 || { tail -n 20 $(STUDY)/$*.log; exit 1; }
	@date > $@
	@echo "pretrained $*"

study-compare: $(STAMP)
	$(STUDY_ENV) $(VENV)/bin/torchrun --nproc-per-node $(STUDY_JOBS) --no-python $(SSLVIT) compare \
		$(foreach method,$(STUDY_METHODS),$(call study_group,$(method))) --scratch 2 --baseline scratch \
		--suite $(STUDY_SUITE) $(if $(STUDY_CLAIMS),--claims $(STUDY_CLAIMS)) --out $(STUDY)/compare --overwrite

# ssl-vit beside its peers (benchmarks/peers/, issue 43): .venv-peers holds the project and the peers at
# requirements/peers*.txt's versions, under the same constraints as .venv (torch stays the tested one).
# First the adapter tests (every adapter builds its peer's model, takes one step at a tiny size, and a
# checkpoint the peer saved loads through ssl-vit's loader; a skip fails), then one training step of
# every shared method, interleaved, at S/16 and B/16, 224 px, batch 8 on the CPU, written to
# benchmarks/peers/RESULTS.md, then the same JPEGs through ssl-vit's ShardDataModule, webdataset, litdata
# and mosaicml-streaming (feed.py, its table appended there; images under runs/peers/feed).
# PEERS_SPEED_ARGS, PEERS_FEED_ARGS: other sizes or rounds (e.g. --variants S/16 --rounds 5; 3 rounds keep make peers under 2 h on 2 cores).
# Then quality.py: each peer's MAE and SimMIM trained at the study's budget (one peer per core), and
# `ssl-vit compare` of them against ssl-vit's own (make study's mae and simmim runs, trained here first
# where missing) on the study's suite without fine-tuning, with verdicts on benchmarks/peers/claims.yaml.
PEERS_VENV := .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed
PEERS_SPEED_ARGS ?= --variants S/16 B/16 --batch-size 8 --rounds 3
PEERS_FEED_ARGS ?= --images 5000 --workers 1 2 --batches 30
PEERS_QUALITY_ARGS ?= --methods mae simmim --seeds 0 1 --out runs/peers/quality
PEERS_QUALITY := OMP_NUM_THREADS=1 $(PEERS_PY) benchmarks/peers/quality.py $(PEERS_QUALITY_ARGS)

$(PEERS_STAMP): pyproject.toml $(CONSTRAINTS) requirements/peers.txt requirements/peers-no-deps.txt
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install --quiet --upgrade pip
	$(PEERS_PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]' -r requirements/peers.txt
	$(PEERS_PY) -m pip install --quiet -c $(CONSTRAINTS) --no-deps -r requirements/peers-no-deps.txt
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)
	cd benchmarks/peers && OMP_NUM_THREADS=1 ../../$(PEERS_PY) -m pytest -q -p no:cacheprovider -c /dev/null \
		--rootdir . -rs test_adapters.py
	OMP_NUM_THREADS=1 $(PEERS_PY) benchmarks/peers/speed.py $(PEERS_SPEED_ARGS) --results benchmarks/peers/RESULTS.md
	OMP_NUM_THREADS=1 $(PEERS_PY) benchmarks/peers/feed.py $(PEERS_FEED_ARGS) --results benchmarks/peers/RESULTS.md
	$(MAKE) --no-print-directory study-pretrain STUDY_METHODS="mae simmim"
	$(PEERS_QUALITY) --peers adapter_lightly --no-compare & lightly=$$!; \
	$(PEERS_QUALITY) --peers adapter_stable_pretraining --no-compare; sp=$$?; wait $$lightly && [ $$sp = 0 ]
	$(PEERS_QUALITY) --results benchmarks/peers/RESULTS.md
	@echo "results: benchmarks/peers/RESULTS.md"

lint: $(STAMP)
	$(VENV)/bin/ruff check ssl_vit tests benchmarks

clean:
	rm -rf $(VENV) $(PEERS_VENV) runs data/shards
