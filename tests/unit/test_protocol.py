import msgspec
import pytest

from hpcserve.contracts import protocol as p

REGISTRY_MESSAGES = [
    p.Register(
        "r1",
        "llama",
        "http://n1:8001",
        pool="chat",
        slurm_job_id=42,
        node="n1",
        tensor_parallel=2,
        load=p.ReplicaLoad(running=3, waiting=1, kv_usage=0.5),
    ),
    p.Heartbeat("r1", p.ReplicaLoad(running=1)),
    p.Deregister("r1", "SIGTERM"),
]


@pytest.mark.parametrize("msg", REGISTRY_MESSAGES, ids=lambda m: type(m).__name__)
def test_registry_messages_round_trip(msg):
    assert p.registry_message_decoder.decode(p.encode(msg)) == msg


@pytest.mark.parametrize(
    "msg",
    [p.Route(7, "llama"), p.Release("r1"), p.ListModels(3), p.ListReplicas(4)],
    ids=lambda m: type(m).__name__,
)
def test_routing_messages_round_trip(msg):
    assert p.routing_message_decoder.decode(p.encode(msg)) == msg


def test_replies_round_trip():
    info = p.ReplicaInfo("r1", "llama", "http://x", "chat", 1, "n1", 3.0, 0.5, 2, p.ReplicaLoad())
    for reply in (
        p.RouteReply(1, "r1", "http://x"),
        p.ModelList(2, [p.ModelInfo("llama", 2)]),
        p.ReplicaList(3, [info]),
    ):
        assert p.routing_reply_decoder.decode(p.encode(reply)) == reply
    for reply in (p.RegistryAck("r1", 6.0), p.ReRegister("r1")):
        assert p.registry_reply_decoder.decode(p.encode(reply)) == reply


def test_tags_are_unique_across_all_messages():
    structs = [
        p.Register,
        p.Heartbeat,
        p.Deregister,
        p.RegistryAck,
        p.ReRegister,
        p.Route,
        p.RouteReply,
        p.Release,
        p.ListModels,
        p.ModelList,
        p.ListReplicas,
        p.ReplicaList,
    ]
    tags = [s.__struct_config__.tag for s in structs]
    assert len(set(tags)) == len(tags)


def test_an_older_peer_decodes_a_message_with_a_new_field():
    class RegisterV2(msgspec.Struct, frozen=True, tag="register"):
        replica_id: str
        model: str
        url: str
        new_field: str = "x"

    decoded = p.registry_message_decoder.decode(p.encode(RegisterV2("r", "m", "u")))
    assert decoded == p.Register("r", "m", "u")


def test_a_register_without_optional_fields_gets_defaults():
    class MinimalRegister(msgspec.Struct, tag="register"):
        replica_id: str
        model: str
        url: str

    decoded = p.registry_message_decoder.decode(p.encode(MinimalRegister("r", "m", "u")))
    assert decoded.load == p.ReplicaLoad() and decoded.tensor_parallel == 1


def test_garbage_and_wrong_conversation_are_rejected():
    with pytest.raises(msgspec.DecodeError):
        p.registry_message_decoder.decode(b"\x93garbage")
    with pytest.raises(msgspec.ValidationError):
        p.registry_message_decoder.decode(p.encode(p.Route(1, "m")))
