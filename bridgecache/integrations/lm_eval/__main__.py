"""`python -m bridgecache.integrations.lm_eval ARGS`: lm_eval's command line with the "bridgecache"
model registered (importing the package registered it; lm-eval 0.4 has no entry point for models)."""

from lm_eval.__main__ import cli_evaluate

import bridgecache.integrations.lm_eval  # noqa: F401  (registers --model bridgecache)

if __name__ == "__main__":
    cli_evaluate()
