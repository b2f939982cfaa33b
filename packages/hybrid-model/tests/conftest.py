"""Per-test isolation of process-wide metric trackers.

megatron-core's MoE metrics tracker and dsv4-attention's indexer-loss tracker are process globals sized by the
first model that records into them; a later test with more layers would index past their end.
"""

import pytest


@pytest.fixture(autouse=True)
def _fresh_metric_trackers():
    yield
    import sys

    if "megatron.core.transformer.moe.moe_logging" in sys.modules:
        sys.modules["megatron.core.transformer.moe.moe_logging"].destroy_moe_metrics_tracker()
    if "dsv4_attention" in sys.modules:
        sys.modules["dsv4_attention"].get_indexer_loss_tracker().reset()
