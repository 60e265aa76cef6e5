# The two entry points of the README. Both create .venv on first use (scripts/setup.sh).
VENV ?= .venv
OUT ?= out

.PHONY: demo test

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	./scripts/setup.sh $(VENV)

demo: $(VENV)/.installed
	$(VENV)/bin/dpmf curves --schedule exponential --beta 0.1 \
	    --n 16,32,64,128,256,512,1024,2048,4096 \
	    --factorizations identity,sqrt_prefix,sqrt_prefix_scaled,lr_aware,sqrt,bisr:16,lr_bisr:16 \
	    --out $(OUT)/curves

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q
