"""`python -m mint_client.cli`: the same as the `mint` console script."""

from mint_client.cli import run

run()
