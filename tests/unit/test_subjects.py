from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetlease.transport.subjects import (
    HOST_VERBS,
    OPS_VERBS,
    QUEUE_CONTROL,
    QUEUES,
    Channel,
    HostSubject,
    Subjects,
    queue_group,
)

S = Subjects()
BAD_TOKENS = ["", "a.b", "a*", ">", "a b", "a\tb", "a\n", "x" * 65, "é", "a/b"]


def test_default_prefix_builds_the_documented_trees() -> None:
    assert S.register("h1") == "fleetlease.host.h1.control.register"
    assert S.heartbeat("h1") == "fleetlease.host.h1.control.heartbeat"
    assert S.reconcile("h1") == "fleetlease.host.h1.control.reconcile"
    assert S.claim("h1") == "fleetlease.host.h1.jobs.claim"
    assert S.ack("h1") == "fleetlease.host.h1.jobs.ack"
    assert S.renew("h1") == "fleetlease.host.h1.jobs.renew"
    assert S.progress("h1") == "fleetlease.host.h1.jobs.progress"
    assert S.result("h1") == "fleetlease.host.h1.jobs.result"
    assert S.cancel_poll("h1") == "fleetlease.host.h1.jobs.cancel_poll"
    assert S.log_append("h1") == "fleetlease.host.h1.logs.append"
    assert S.artifact_chunk("h1") == "fleetlease.host.h1.artifacts.chunk"
    assert S.artifact_commit("h1") == "fleetlease.host.h1.artifacts.commit"
    assert S.ops("alice", "submit") == "fleetlease.ops.alice.submit"
    assert S.ops_identify() == "fleetlease.ops.whoami"
    assert S.ops_user_wildcard("alice") == "fleetlease.ops.alice.>"
    assert S.events_task() == "fleetlease.events.task"


def test_wildcards_cover_one_channel_each() -> None:
    assert S.control_wildcard() == "fleetlease.host.*.control.>"
    assert S.jobs_wildcard() == "fleetlease.host.*.jobs.>"
    assert S.logs_wildcard() == "fleetlease.host.*.logs.>"
    assert S.artifacts_wildcard() == "fleetlease.host.*.artifacts.>"
    assert S.ops_wildcard() == "fleetlease.ops.>"


def test_each_channel_has_its_own_queue_group() -> None:
    assert QUEUE_CONTROL == "fleetlease-control"
    assert len(set(QUEUES.values())) == len(Channel)
    assert queue_group(Channel.LOGS) == "fleetlease-logs"


def test_custom_prefix_with_dots_is_used_everywhere() -> None:
    s = Subjects("acme.prod")
    assert s.claim("h") == "acme.prod.host.h.jobs.claim"
    assert s.jobs_wildcard() == "acme.prod.host.*.jobs.>"
    assert s.parse_host_subject("acme.prod.host.h.jobs.claim") == ("h", Channel.JOBS, "claim")


@pytest.mark.parametrize("prefix", ["", ".", "a.", ".a", "a..b", "a*", "a>", "a b", "x" * 129])
def test_bad_prefix_is_rejected(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Subjects(prefix)


@pytest.mark.parametrize("host_id", BAD_TOKENS)
def test_bad_host_id_is_rejected_naming_the_parameter(host_id: str) -> None:
    with pytest.raises(ValueError, match="host_id"):
        S.claim(host_id)
    with pytest.raises(ValueError, match="host_id"):
        S.host_inbox_prefix(host_id)


def test_non_str_host_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="host_id"):
        S.claim(7)  # type: ignore[arg-type]


@pytest.mark.parametrize("verb", BAD_TOKENS)
def test_bad_ops_verb_is_rejected(verb: str) -> None:
    with pytest.raises(ValueError, match="verb"):
        S.ops("alice", verb)


@pytest.mark.parametrize("user", BAD_TOKENS)
def test_bad_ops_user_is_rejected(user: str) -> None:
    with pytest.raises(ValueError, match="user"):
        S.ops(user, "whoami")
    with pytest.raises(ValueError, match="user"):
        S.ops_user_wildcard(user)


def test_verb_must_belong_to_its_channel() -> None:
    with pytest.raises(ValueError, match="verb"):
        S.host("h1", Channel.CONTROL, "claim")
    with pytest.raises(ValueError, match="channel"):
        S.host("h1", Channel.OPS, "submit")


def test_every_host_subject_parses_back() -> None:
    for channel, verbs in HOST_VERBS.items():
        for verb in verbs:
            subject = S.host("host-7", channel, verb)
            assert S.parse_host_subject(subject) == HostSubject("host-7", channel, verb)


_HOST_ID_CHARS = string.ascii_letters + string.digits + "_-"


@given(
    # st.text over the alphabet rather than st.from_regex: from_regex imports its
    # module lazily, under pytest's assertion rewriting, in the middle of a suite
    # whose other threads may be parsing too, which hit CPython 3.11.7's
    # "AST constructor recursion depth mismatch" (python/cpython#106905).
    host_id=st.text(alphabet=_HOST_ID_CHARS, min_size=1, max_size=64),
    channel_verb=st.sampled_from([(c, v) for c, vs in HOST_VERBS.items() for v in sorted(vs)]),
)
def test_parse_host_subject_round_trips(host_id: str, channel_verb: tuple[Channel, str]) -> None:
    channel, verb = channel_verb
    assert S.parse_host_subject(S.host(host_id, channel, verb)) == (host_id, channel, verb)


@pytest.mark.parametrize(
    "subject",
    [
        "",
        "fleetlease",
        "fleetlease.host.h1.jobs",
        "fleetlease.host.h1.jobs.claim.extra",
        "other.host.h1.jobs.claim",
        "fleetlease.ops.submit.x.y",
        "fleetlease.host.*.jobs.claim",
        "fleetlease.host.h1.jobs.register",
        "fleetlease.host.h1.nope.claim",
        "fleetlease.host..jobs.claim",
        "fleetlease.hosts.h1.jobs.claim",
    ],
)
def test_parse_host_subject_rejects_other_shapes(subject: str) -> None:
    with pytest.raises(ValueError):
        S.parse_host_subject(subject)


@given(st.text(max_size=80))
def test_parse_host_subject_raises_only_value_error(subject: str) -> None:
    try:
        parsed = S.parse_host_subject(subject)
    except ValueError:
        return
    assert S.host(*parsed) == subject


def test_parse_ops_subject() -> None:
    assert S.parse_ops_subject("fleetlease.ops.alice.tasks") == ("alice", "tasks")
    assert S.parse_ops_subject("fleetlease.ops.whoami") == (None, "whoami")
    for bad in [
        "fleetlease.ops.",
        "fleetlease.ops.tasks",  # a verb without a user: only whoami identifies
        "fleetlease.ops.a.b.c",
        "fleetlease.ops.a.",
        "fleetlease.ops..b",
        "fleetlease.ops.a*.b",
        "fleetlease.host.h.jobs.claim",
    ]:
        with pytest.raises(ValueError):
            S.parse_ops_subject(bad)


def test_known_ops_verbs_are_valid_tokens() -> None:
    for verb in OPS_VERBS:
        assert S.parse_ops_subject(S.ops("bob", verb)) == ("bob", verb)


def test_a_reply_is_allowed_only_in_the_requesters_own_inbox() -> None:
    alice = S.ops("alice", "whoami")
    host = S.claim("h1")
    assert S.reply_allowed(alice, "_INBOX_fleetlease.ops.alice.abc.1")
    assert S.reply_allowed(host, "_INBOX_fleetlease.host.h1.xyz")
    assert S.reply_allowed(S.ops_identify(), "_INBOX_fleetlease.anon.q")
    for subject, reply in [
        (alice, "$JS.API.STREAM.PURGE.OBJ_fleetlease-artifacts-fleetlease"),
        (alice, "$O.bucket.C.x"),
        (alice, "$KV.b.k"),
        (alice, "$SYS.REQ.SERVER.PING"),
        (alice, "_INBOX_fleetlease.ops.bob.abc"),  # another user's inbox
        (alice, "_INBOX_fleetlease.ops.alicex.abc"),  # a prefix of a name is not it
        (alice, "_INBOX_fleetlease.ops.alice"),  # the prefix itself
        (alice, "_INBOX_fleetlease.ops.alice."),
        (alice, "_INBOX_fleetlease.ops.alice.a..b"),
        (alice, "_INBOX_fleetlease.ops.alice.>"),
        (alice, "_INBOX_fleetlease.ops.alice.*"),
        (alice, "_INBOX_fleetlease.host.alice.abc"),
        (alice, "fleetlease.host.h1.jobs.claim"),
        (host, "_INBOX_fleetlease.host.h2.abc"),  # another host's inbox
        (host, "_INBOX_fleetlease.ops.h1.abc"),
        (host, "$JS.API.STREAM.PURGE.x"),
        (S.ops_identify(), "_INBOX_fleetlease.ops.alice.abc"),
        ("fleetlease.events.task", "_INBOX_fleetlease.anon.q"),  # names no principal
    ]:
        assert not S.reply_allowed(subject, reply), (subject, reply)
    assert S.reply_inbox(alice) == ("user:alice", "_INBOX_fleetlease.ops.alice")
    assert S.reply_inbox(host) == ("host:h1", "_INBOX_fleetlease.host.h1")
    assert S.reply_inbox("nonsense") is None
    # By position, as the broker's permissions: an unknown verb still gets its
    # typed error, in the sender's own inbox.
    assert S.reply_allowed("fleetlease.host.h1.jobs.explode", "_INBOX_fleetlease.host.h1.a")
    assert S.reply_allowed("fleetlease.ops.alice.nope.x", "_INBOX_fleetlease.ops.alice.a")
    assert S.reply_allowed("fleetlease.ops.tasks", "_INBOX_fleetlease.anon.a")
    assert S.reply_inbox("fleetlease.host.h*.jobs.claim") is None
    assert S.reply_inbox("fleetlease.host.h1") is None
    assert S.reply_inbox("other.host.h1.jobs.claim") is None


def test_client_inboxes_are_disjoint_from_the_system_subjects() -> None:
    wildcards = S.client_inbox_wildcards()
    assert wildcards == [
        "_INBOX_fleetlease.host.*.>",
        "_INBOX_fleetlease.ops.*.>",
        "_INBOX_fleetlease.anon.>",
    ]
    for w in wildcards:
        assert not w.startswith(("$", "_INBOX.", "fleetlease."))


def test_inbox_prefixes_keep_hosts_and_users_apart() -> None:
    assert S.host_inbox_prefix("h1") == "_INBOX_fleetlease.host.h1"
    assert S.ops_inbox_prefix("alice") == "_INBOX_fleetlease.ops.alice"
    # A host called "ops" must not share a tree with the users' inboxes.
    assert not S.ops_inbox_prefix("alice").startswith(S.host_inbox_prefix("ops") + ".")
    with pytest.raises(ValueError, match="user"):
        S.ops_inbox_prefix("a.b")
    assert S.anon_inbox_prefix() == "_INBOX_fleetlease.anon"
    assert not S.anon_inbox_prefix().startswith(S.ops_inbox_prefix("anon"))
