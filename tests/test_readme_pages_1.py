"""The documentation's blocks run verbatim, part 1 of tests/docs_blocks.py's split (its groups of pages: the
split balances the parts' measured cost over `make test`'s workers; the rules are tested in tests/test_readme.py)."""

import pytest

from docs_blocks import block_params, run_block


@pytest.mark.parametrize("block", block_params(1))
def test_docs_block_runs_verbatim(block, readme_envs):
    run_block(block, readme_envs)
