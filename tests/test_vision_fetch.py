"""Image URLs: refused unless the deployment enables downloads, and then only from allowed
hosts at allowed addresses, checked again on every redirect, within byte and time limits. The
server is a real aiohttp server on loopback, which is exactly what a default policy refuses:
the positive cases name it in `allow_networks`."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from serve_app.protocol.openai import ImagePart
from serve_app.vision import FetchPolicy, ImagePolicy, ImageRejected, MediaConfig
from serve_app.vision import load_images as _load_images
from serve_app.vision.fetch import address_allowed, host_allowed

MEDIA = MediaConfig.from_folder(Path(__file__).parent / "data" / "vision")
WHERE = "messages[0].content[0]"
PARAM = f"{WHERE}.image_url"
PHOTO = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 40, 3), dtype=np.uint8))
_buffer = io.BytesIO()
PHOTO.save(_buffer, "PNG")
PNG = _buffer.getvalue()


class Server:
    """One app on two loopback addresses (127.0.0.1 and 127.0.0.2), recording which address
    each request reached."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, str]] = []  # (local address, path)
        self.ports: dict[str, int] = {}

    def url(self, address: str, path: str) -> str:
        return f"http://{address}:{self.ports[address]}{path}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        local = request.transport.get_extra_info("sockname")[0]
        self.hits.append((local, request.path))
        path = request.path
        if path == "/photo.png":
            return web.Response(body=PNG, content_type="image/png")
        if path.startswith("/to/"):  # /to/<address>/<path>: a redirect
            _, _, address, rest = path.split("/", 3)
            raise web.HTTPFound(self.url(address, "/" + rest))
        if path == "/to-name":
            raise web.HTTPFound(f"http://localhost:{self.ports['127.0.0.1']}/photo.png")
        if path == "/loop":
            raise web.HTTPFound("/loop")
        if path == "/big":
            return web.Response(body=b"\0" * 5000, content_type="image/png")
        if path == "/big-chunked":
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(10):
                await response.write(b"\0" * 500)
            await response.write_eof()
            return response
        if path == "/slow":
            await asyncio.sleep(2)
            return web.Response(body=PNG)
        raise web.HTTPNotFound()


@pytest.fixture
async def server():
    state = Server()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", state.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    for address in ("127.0.0.1", "127.0.0.2"):
        site = web.TCPSite(runner, address, 0)
        await site.start()
        state.ports[address] = site._server.sockets[0].getsockname()[1]
    yield state
    await runner.cleanup()


def _policy(**fetch: object) -> ImagePolicy:
    return ImagePolicy(fetch=FetchPolicy(enabled=True, **fetch))


LOOPBACK_1 = {"allow_hosts": ("127.0.0.1",), "allow_networks": ("127.0.0.1/32",)}


async def load(url: str, policy: ImagePolicy):
    return await _load_images([ImagePart(WHERE, url)], policy, MEDIA)


async def rejected(url: str, policy: ImagePolicy) -> ImageRejected:
    with pytest.raises(ImageRejected) as error:
        await load(url, policy)
    assert error.value.param == PARAM
    assert "127.0.0" not in error.value.message and "localhost" not in error.value.message
    return error.value


async def test_default_policy_does_not_download(server: Server) -> None:
    error = await rejected(server.url("127.0.0.1", "/photo.png"), ImagePolicy())
    assert error.status == 400 and "data URL" in error.message
    assert server.hits == []


def test_enabling_downloads_needs_named_hosts() -> None:
    with pytest.raises(ValueError, match="allow_hosts"):
        FetchPolicy(enabled=True)
    with pytest.raises(ValueError, match="not a host name"):
        FetchPolicy(enabled=True, allow_hosts=("http://example.com/",))


async def test_download_from_an_allowed_private_network(server: Server) -> None:
    [prepared] = await load(server.url("127.0.0.1", "/photo.png"), _policy(**LOOPBACK_1))
    assert (prepared.width, prepared.height) == (40, 30)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(prepared.png))), np.asarray(PHOTO))
    # And through a redirect that stays inside what is allowed.
    both = _policy(allow_hosts=("127.0.0.1", "127.0.0.2"), allow_networks=("127.0.0.0/30",))
    [prepared] = await load(server.url("127.0.0.2", "/to/127.0.0.1/photo.png"), both)
    assert prepared.width == 40


async def test_loopback_is_refused_without_the_opt_in(server: Server) -> None:
    error = await rejected(server.url("127.0.0.1", "/photo.png"),
                           _policy(allow_hosts=("127.0.0.1",)))
    assert "network address" in error.message
    # A name is refused for what it resolves to.
    port = server.ports["127.0.0.1"]
    error = await rejected(f"http://localhost:{port}/photo.png", _policy(allow_hosts=("*",)))
    assert "network address" in error.message
    assert server.hits == []


async def test_redirect_to_loopback_is_refused(server: Server) -> None:
    # 127.0.0.2 is allowed; it redirects to 127.0.0.1, which is not.
    policy = _policy(allow_hosts=("127.0.0.1", "127.0.0.2"), allow_networks=("127.0.0.2/32",))
    error = await rejected(server.url("127.0.0.2", "/to/127.0.0.1/photo.png"), policy)
    assert error.status == 400 and "network address" in error.message
    assert server.hits == [("127.0.0.2", "/to/127.0.0.1/photo.png")]  # never reached .1


async def test_hosts_off_the_list_are_refused(server: Server) -> None:
    error = await rejected(server.url("127.0.0.1", "/photo.png"),
                           _policy(allow_hosts=("images.example.com",),
                                   allow_networks=("127.0.0.0/8",)))
    assert "host" in error.message
    # A redirect to a host off the list, too.
    error = await rejected(server.url("127.0.0.1", "/to-name"), _policy(**LOOPBACK_1))
    assert "host" in error.message
    assert server.hits == [("127.0.0.1", "/to-name")]


async def test_size_limits(server: Server) -> None:
    policy = _policy(max_bytes=1000, **LOOPBACK_1)
    for path in ("/big", "/big-chunked"):
        error = await rejected(server.url("127.0.0.1", path), policy)
        assert error.status == 413 and "1000" in error.message
    # The image limit bounds downloads too.
    tight = ImagePolicy(max_image_bytes=1000, fetch=FetchPolicy(enabled=True, **LOOPBACK_1))
    assert (await rejected(server.url("127.0.0.1", "/big"), tight)).status == 413


async def test_time_limit(server: Server) -> None:
    error = await rejected(server.url("127.0.0.1", "/slow"),
                           _policy(timeout_s=0.2, **LOOPBACK_1))
    assert error.status == 400 and "within 0.2 s" in error.message


async def test_redirect_count_and_status(server: Server) -> None:
    error = await rejected(server.url("127.0.0.1", "/loop"), _policy(max_redirects=2, **LOOPBACK_1))
    assert "more than 2" in error.message
    assert len(server.hits) == 3
    error = await rejected(server.url("127.0.0.1", "/missing"), _policy(**LOOPBACK_1))
    assert "HTTP 404" in error.message


def test_addresses() -> None:
    fetch = FetchPolicy()
    for public in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):
        assert address_allowed(public, fetch), public
    for private in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                    "100.64.0.1", "0.0.0.0", "224.0.0.1", "239.1.1.1", "240.0.0.1",
                    "255.255.255.255", "::1", "::", "fe80::1%eth0", "fc00::1", "ff02::1",
                    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "2002:a00:1::1", "64:ff9b::a00:1",
                    "not an address"):
        assert not address_allowed(private, fetch), private
    opted_in = FetchPolicy(allow_networks=("10.1.0.0/16",))
    assert address_allowed("10.1.2.3", opted_in) and not address_allowed("10.2.0.1", opted_in)


def test_host_patterns() -> None:
    fetch = FetchPolicy(allow_hosts=("example.com", "*.images.example.org"))
    assert host_allowed("example.com", fetch) and host_allowed("EXAMPLE.com.", fetch)
    assert not host_allowed("www.example.com", fetch)
    assert host_allowed("a.images.example.org", fetch)
    assert not host_allowed("images.example.org", fetch)
    assert not host_allowed("evilimages.example.org", fetch)
