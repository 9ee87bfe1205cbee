"""The gRPC message benchmark on real processes: every transport streams, both sides counted."""

import pytest

from bench import grpc_message


@pytest.mark.parametrize("arm", grpc_message.ARMS)
def test_each_transport_streams_and_both_sides_spend_cpu(arm):
    sample = grpc_message.measure(arm, messages=grpc_message.WARM_UP + 200, gap_s=0.001)
    assert sample["send us/message"] > 0 and sample["receive us/message"] > 0
