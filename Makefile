# The two entry points of the README. Both create .venv on first use (scripts/setup.sh).
VENV ?= .venv
OUT ?= out

.PHONY: demo test

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	./scripts/setup.sh $(VENV)

demo: $(VENV)/.installed
	$(VENV)/bin/dpmf train --dataset fashion-mnist --model cnn --optimizer dp-muon \
	    --factorization auto --max-bands 64 --schedule cosine --beta 0.1 \
	    --batch-size 1024 --epochs 5 --epsilon 3 --delta 1e-5 --threads 2 \
	    --out $(OUT)/demo $(if $(wildcard $(OUT)/demo/checkpoint.pt),--resume)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q --numprocesses=auto --maxprocesses=4
