"""API keys of the gateway without Lua: secrets and hashes, records read back and checked,
tenant scoping, lane choice (fakeredis; the quota script runs in
tests/integration/test_gateway_quota.py)."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import fakeredis
import pytest

from plurai.broker_config import keys, protocol
from plurai.broker_config.protocol import Limits
from plurai.broker_config.settings import Settings
from plurai.gateway import apikeys, auth, quota

SETTINGS = Settings(lanes=["interactive", "standard", "batch"], default_lane="standard")


def make_key(**kw) -> apikeys.Key:
    fields = dict(id="0123456789ab", tenant="acme", lanes=("standard",), default_lane="standard")
    return apikeys.Key(**{**fields, **kw})


def authenticate(server: fakeredis.FakeServer, secret, decode: bool = False):
    async def go():
        r = fakeredis.FakeAsyncRedis(server=server, decode_responses=decode)
        try:
            return await apikeys.authenticate(r, secret)
        finally:
            await r.aclose()

    return asyncio.run(go())


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def r(server):
    return fakeredis.FakeRedis(server=server)


def test_secret_shape_and_hash():
    a, b = apikeys.new_secret(), apikeys.new_secret()
    assert a != b and a.startswith("pk-") and len(a) == 46
    assert apikeys._SECRET.fullmatch(a)
    h = apikeys.hash_secret(a)
    assert h == hashlib.sha256(a.encode()).hexdigest()
    assert apikeys.key_id(h) == h[:12]


def test_bearer():
    assert apikeys.bearer("Bearer pk-abc") == "pk-abc"
    assert apikeys.bearer("bearer   pk-abc ") == "pk-abc"
    assert apikeys.bearer("Basic dXNlcg==") is None
    assert apikeys.bearer("Bearer ") is None
    assert apikeys.bearer(None) is None and apikeys.bearer("") is None


def test_create_stores_only_the_hash(r, server):
    secret, key = apikeys.create_key(r, "acme", rpm=10, tpm=1000, concurrent=2, settings=SETTINGS)
    h = apikeys.hash_secret(secret)
    assert key.id == h[:12] and key.tenant == "acme"
    assert key.lanes == ("interactive", "standard", "batch") and key.default_lane == "standard"
    assert r.hget(keys.API_KEYS, key.id) == h.encode()
    assert set(r.keys("*")) == {keys.API_KEYS.encode(), keys.api_key(h).encode()}
    for k in r.keys("*"):
        blob = repr(r.hgetall(k)).encode() + k
        assert secret.encode() not in blob and secret[3:].encode() not in blob
    for decode in (False, True):
        assert authenticate(server, secret, decode) == key
    assert authenticate(server, apikeys.new_secret()) is None
    assert apikeys.any_keys(r)


def test_create_checks_its_arguments(r):
    with pytest.raises(ValueError, match="tenant"):
        apikeys.create_key(r, "a:b", settings=SETTINGS)
    with pytest.raises(ValueError, match="tenant"):
        apikeys.create_key(r, "x" * 65, settings=SETTINGS)
    with pytest.raises(ValueError, match="tenant"):
        apikeys.create_key(r, "", settings=SETTINGS)
    with pytest.raises(ValueError, match="unknown lane"):
        apikeys.create_key(r, "acme", lanes=["gold"], settings=SETTINGS)
    with pytest.raises(ValueError, match="default lane"):
        apikeys.create_key(r, "acme", lanes=["batch"], default_lane="standard", settings=SETTINGS)
    with pytest.raises(ValueError, match="rpm"):
        apikeys.create_key(r, "acme", rpm=-1, settings=SETTINGS)
    with pytest.raises(ValueError, match="concurrent"):
        apikeys.create_key(r, "acme", concurrent=True, settings=SETTINGS)
    assert not apikeys.any_keys(r)
    _, key = apikeys.create_key(r, "acme.eu_1-x", lanes=["batch", "interactive"], settings=SETTINGS)
    assert key.default_lane == "batch"  # the configured default is not allowed: the first


def test_malformed_secrets_never_reach_redis():
    class NoRedis:
        async def hgetall(self, name):
            raise AssertionError("no Redis call for a malformed secret")

    for bad in (None, "", "pk-", "pk-short", "sk-" + "a" * 43, "pk-" + "a" * 200, "pk-a b" * 8, 42):
        assert asyncio.run(apikeys.authenticate(NoRedis(), bad)) is None


def record(key_hash: str, **over) -> dict[str, str]:
    base = {
        "id": key_hash[:12],
        "tenant": "acme",
        "lanes": "interactive,standard",
        "default_lane": "standard",
        "rpm": "10",
        "tpm": "0",
        "concurrent": "0",
        "created_ms": "1700000000000",
    }
    return {k: v for k, v in {**base, **over}.items() if v is not None}


DAMAGED = [
    {"id": "ffffffffffff"},
    {"id": None},
    {"tenant": ""},
    {"tenant": "a:b"},
    {"tenant": "x" * 65},
    {"lanes": ""},
    {"lanes": "standard,standard"},
    {"lanes": "a b"},
    {"default_lane": "batch"},
    {"rpm": "-1"},
    {"rpm": "1e3"},
    {"rpm": " 5"},
    {"tpm": "9" * 16},
    {"concurrent": "١٢"},
    {"created_ms": None},
    {"admin": "2"},
    {"admin": "yes"},
]


@pytest.mark.parametrize("over", DAMAGED)
def test_damaged_records_are_unknown_keys(server, r, caplog, over):
    secret = apikeys.new_secret()
    h = apikeys.hash_secret(secret)
    raw = {k.encode(): v.encode() for k, v in record(h).items()}  # records are read undecoded
    assert apikeys.parse_record(h, raw).rpm == 10
    r.hset(keys.api_key(h), mapping=record(h, **over))
    with caplog.at_level(logging.DEBUG):
        for decode in (False, True):
            assert authenticate(server, secret, decode) is None
    assert "damaged record" in caplog.text and h[:12] in caplog.text
    assert secret not in caplog.text and h not in caplog.text


def test_records_not_utf8_or_not_a_hash(server, r, caplog):
    secret = apikeys.new_secret()
    h = apikeys.hash_secret(secret)
    r.hset(keys.api_key(h), mapping={**record(h), "tenant": b"\xff\xfe"})
    with caplog.at_level(logging.DEBUG):
        assert authenticate(server, secret, decode=False) is None
        assert authenticate(server, secret, decode=True) is None
        r.delete(keys.api_key(h))
        r.set(keys.api_key(h), "not a hash")
        assert authenticate(server, secret) is None
    assert "not a hash" in caplog.text and secret not in caplog.text


def test_list_and_revoke(r, server, capsys):
    s1, k1 = apikeys.create_key(r, "acme", rpm=5, settings=SETTINGS)
    s2, k2 = apikeys.create_key(r, "globex", lanes=["batch"], settings=SETTINGS)
    r.hset(keys.API_KEYS, "00000000dead", "not-a-hash")  # damaged index entry
    r.hset(keys.API_KEYS, "../../x", "y")  # not an id: ignored
    found, broken = apikeys.list_keys(r)
    assert {k.id for k in found} == {k1.id, k2.id} and broken == ["00000000dead"]
    r.hset(keys.api_key(apikeys.hash_secret(s2)), "rpm", "lots")
    found, broken = apikeys.list_keys(r)
    assert [k.id for k in found] == [k1.id] and broken == sorted(["00000000dead", k2.id])

    assert apikeys.revoke(r, k1.id)
    assert authenticate(server, s1) is None
    assert not apikeys.revoke(r, k1.id) and not apikeys.revoke(r, "nonsense")
    assert apikeys.revoke(r, "00000000dead") and apikeys.revoke(r, k2.id)
    r.hdel(keys.API_KEYS, "../../x")
    assert not apikeys.any_keys(r)


def test_any_keys_fails_closed(r, server):
    r.set(keys.API_KEYS, "garbage")  # damaged index: still "keys configured"
    assert apikeys.any_keys(r)

    async def go():
        ar = fakeredis.FakeAsyncRedis(server=server)
        try:
            return await apikeys.any_keys_async(ar)
        finally:
            await ar.aclose()

    assert asyncio.run(go())


def test_scoped_idempotency_keys():
    a, b = make_key(tenant="acme"), make_key(tenant="globex")
    assert auth.scoped_idempotency_key(a, "k1") != auth.scoped_idempotency_key(b, "k1")
    assert auth.scoped_idempotency_key(a, "k1") == auth.scoped_idempotency_key(a, "k1")
    assert auth.scoped_idempotency_key(a, None) is None
    assert auth.scoped_idempotency_key(None, "k1") == "k1"
    # no tenant can forge another's scope: tenant names hold no ':'
    assert auth.scoped_idempotency_key(make_key(tenant="a"), "b:c") != auth.scoped_idempotency_key(
        make_key(tenant="a.b"), "c"
    )


def test_tenant_salts():
    a, b = make_key(tenant="acme"), make_key(tenant="globex")
    assert auth.tenant_salt(a, None) == "acme" and auth.tenant_salt(a, "") == "acme"
    assert auth.tenant_salt(a, "s") == "acme:s"
    assert auth.tenant_salt(a, "s") != auth.tenant_salt(b, "s")
    assert auth.tenant_salt(a, "globex") != auth.tenant_salt(b, None)
    assert auth.tenant_salt(None, "s") == "s" and auth.tenant_salt(None, None) is None
    longest = make_key(tenant="t" * protocol.TENANT_CHARS)
    for salt in ("x" * Limits.cache_salt_chars, "y" * (Limits.cache_salt_chars - 10)):
        got = auth.tenant_salt(longest, salt)
        assert len(got) <= Limits.cache_salt_chars and got.startswith("t" * 64 + ":")
    assert auth.tenant_salt(longest, "x" * 256) != auth.tenant_salt(longest, "x" * 255)


def test_lane_for():
    key = make_key(lanes=("interactive", "standard"), default_lane="interactive")
    assert auth.lane_for(key, None, SETTINGS) == "interactive"
    assert auth.lane_for(key, "standard", SETTINGS) == "standard"
    with pytest.raises(auth.LaneError, match="not allowed for this API key"):
        auth.lane_for(key, "batch", SETTINGS)
    with pytest.raises(ValueError, match="not configured"):  # a lane since removed
        auth.lane_for(key, "interactive", Settings(lanes=["standard"], default_lane="standard"))
    assert auth.lane_for(None, None, SETTINGS) == "standard"
    assert auth.lane_for(None, "batch", SETTINGS) == "batch"
    with pytest.raises(auth.LaneError, match="unknown lane"):
        auth.lane_for(None, "gold", SETTINGS)


def test_admit_checks_arguments_and_skips_redis_without_limits():
    class NoRedis:
        def __getattr__(self, name):
            raise AssertionError("no Redis call for a key without limits")

    free = make_key()
    verdict = asyncio.run(quota.admit(NoRedis(), free, 100, "job-0001"))
    assert verdict.admitted and verdict.limit is None
    assert asyncio.run(quota.renew(NoRedis(), free, "job-0001"))
    assert not asyncio.run(quota.release(NoRedis(), free, "job-0001"))
    limited = make_key(rpm=1)
    for tokens, job, lease in (
        (-1, "job-0001", 1),
        (1.5, "job-0001", 1),
        (1, "j:1", 1),
        (1, "job-0001", 0),
    ):
        with pytest.raises(ValueError):
            asyncio.run(quota.admit(NoRedis(), limited, tokens, job, lease_s=lease))


def test_verdict_retry_after_header():
    assert quota.Verdict(False, "rpm", 0.001).retry_after == 1
    assert quota.Verdict(False, "rpm", 5.2).retry_after == 6


def test_a_key_not_in_the_index_is_refused(r, server):
    """The index is what `plurai keys list` shows and `revoke` removes: a record whose
    index entry is damaged or gone is no key (listed as refused, revoked for good)."""
    s1, k1 = apikeys.create_key(r, "acme", settings=SETTINGS)
    s2, k2 = apikeys.create_key(r, "globex", settings=SETTINGS)
    r.hset(keys.API_KEYS, k1.id, "not-a-hash")
    assert apikeys.list_keys(r)[1] == [k1.id]
    r.hdel(keys.API_KEYS, k2.id)  # unlisted: no one can see or revoke it
    for decode in (False, True):
        assert authenticate(server, s1, decode) is None
        assert authenticate(server, s2, decode) is None
    assert apikeys.revoke(r, k1.id)
    assert authenticate(server, s1) is None
    r.hset(keys.API_KEYS, k2.id, apikeys.hash_secret(s2))
    assert authenticate(server, s2) == k2


def test_admin_scope(r, server):
    secret, key = apikeys.create_key(r, "ops", admin=True, settings=SETTINGS)
    assert key.admin and authenticate(server, secret) == key
    plain, other = apikeys.create_key(r, "acme", settings=SETTINGS)
    assert not other.admin and not authenticate(server, plain).admin
    # a record written before the scope existed has no admin field: not an admin
    h = apikeys.hash_secret(plain)
    r.hdel(keys.api_key(h), "admin")
    assert authenticate(server, plain) == other


def test_basic_credentials():
    import base64

    def basic(pair: bytes) -> str:
        return "Basic " + base64.b64encode(pair).decode()

    assert auth.basic_password(basic(b"admin:pk-abc")) == "pk-abc"
    assert auth.basic_password(basic(b":pk-abc")) == "pk-abc"  # any user name, even none
    assert auth.basic_password(basic(b"admin:a:b")) == "a:b"
    for bad in (
        None,
        "",
        "Basic",
        "Basic !!!",
        basic(b"no-colon"),
        basic(b"admin:"),
        basic(b"admin:\xff"),
        "Bearer pk-abc",
        "Basic " + "A" * 2000,
    ):
        assert auth.basic_password(bad) is None, bad


def test_guard_takes_basic_only_where_asked(r, server):
    import base64

    secret, key = apikeys.create_key(r, "ops", admin=True, settings=SETTINGS)
    header = "Basic " + base64.b64encode(f"me:{secret}".encode()).decode()

    async def go(authorization, basic):
        guard = auth.Guard(fakeredis.FakeAsyncRedis(server=server), "127.0.0.1")
        try:
            return await guard.key(authorization, basic=basic)
        finally:
            await guard.r.aclose()

    assert asyncio.run(go(header, True)) == key
    assert asyncio.run(go(f"Bearer {secret}", False)) == key
    with pytest.raises(auth.Unauthorized):
        asyncio.run(go(header, False))
    with pytest.raises(auth.Unauthorized):
        asyncio.run(go(None, True))


def test_an_open_gateway_answers_only_requests_addressed_to_this_machine(server):
    """Without keys, a loopback gateway refuses a request whose Host names another site:
    a web page whose DNS name was rebound to 127.0.0.1 must not reach it."""

    async def go(host):
        guard = auth.Guard(fakeredis.FakeAsyncRedis(server=server), "127.0.0.1")
        try:
            return await guard.key(None, host)
        finally:
            await guard.r.aclose()

    for host in (
        None,
        "",
        "localhost",
        "localhost:8000",
        "127.0.0.1:8000",
        "127.0.0.2",
        "[::1]:8000",
        "::1",
        "app.localhost:80",
        "LOCALHOST.",
        "localhost:",
    ):
        assert asyncio.run(go(host)) is None, host
    for host in (
        "evil.example:8000",
        "evil.example",
        "10.0.0.1",
        "[2001:db8::1]:80",
        "localhost.evil.example",
        "127.0.0.1.evil.example",
    ):
        with pytest.raises(auth.Unauthorized, match="localhost or 127.0.0.1"):
            asyncio.run(go(host))
