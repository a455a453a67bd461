# ssl-vit: the README's commands. Everything runs inside .venv, created here with pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test quickstart lint clean

install: $(STAMP)

# Reinstall whenever the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

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

lint: $(STAMP)
	$(VENV)/bin/ruff check ssl_vit tests

clean:
	rm -rf $(VENV) runs data/shards
