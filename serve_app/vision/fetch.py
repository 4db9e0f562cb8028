"""Downloading an `http(s)://` image for a client, when the deployment allows it.

A server that fetches URLs for its clients can be aimed at its own network (SSRF): its metadata
service, an admin port on loopback, a database on 10.x. So, hop by hop (redirects are followed
here, not by the client library, and each is checked again):
- the scheme is http or https, the host is on `fetch.allow_hosts`;
- every address the host resolves to is public (or inside `fetch.allow_networks`), and the
  connection goes to exactly the addresses that were checked: the check lives in the resolver
  the connector connects with (`_CheckedResolver`), DNS caching is off, so a name that resolves
  to a public address for the check and to 127.0.0.1 for the connection (DNS rebinding) has no
  second lookup to change; an IP literal (which aiohttp connects to without resolving) is
  checked before the request;
- the environment's proxy settings are ignored (a proxy would make the connection for us,
  to wherever the name resolves there);
- bytes are counted as they arrive (after any content decoding, so a gzip bomb stops at the
  limit), and one deadline covers the whole download, redirects included.

aiohttp is the client because the project already has it (ray[serve] depends on it) and it
lets a resolver decide the addresses a connection may use; httpx is only a dev dependency here,
and urllib would block a thread per download and resolve names on its own.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from .config import FetchPolicy, ImagePolicy
from .errors import ImageRejected

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_CHUNK = 64 * 1024

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_allowed(address: str, fetch: FetchPolicy) -> bool:
    """Whether the server may connect to `address`: a public unicast address, or one inside a
    network the operator named."""
    try:
        ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    except ValueError:
        return False
    if any(ip in net for net in fetch.allow_networks):
        return True
    embedded = _embedded_ipv4(ip)
    if embedded is not None and embedded != ip:
        return address_allowed(str(embedded), fetch)
    return (ip.is_global and not ip.is_private and not ip.is_loopback and not ip.is_link_local
            and not ip.is_multicast and not ip.is_reserved and not ip.is_unspecified)


def _embedded_ipv4(ip: IPAddress) -> IPAddress | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), which is where it leads."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def host_allowed(host: str, fetch: FetchPolicy) -> bool:
    host = host.lower().rstrip(".")
    for pattern in fetch.allow_hosts:
        pattern = pattern.lower().rstrip(".")
        if pattern == "*" or host == pattern.strip("[]"):
            return True
        if pattern.startswith("*.") and host.endswith(pattern[1:]):
            return True
    return False


class _AddressRefused(OSError):
    pass


class _CheckedResolver(AbstractResolver):
    """The system resolver, refusing a name if any address it resolves to is not allowed (a name
    with one private address among public ones is not one to trust)."""

    def __init__(self, fetch: FetchPolicy) -> None:
        self._fetch = fetch
        self._system = aiohttp.ThreadedResolver()
        self.refused = False

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._system.resolve(host, port, family)
        if not results or not all(address_allowed(r["host"], self._fetch) for r in results):
            self.refused = True
            raise _AddressRefused("address not allowed")
        return results

    async def close(self) -> None:
        await self._system.close()


async def fetch_image(url: str, policy: ImagePolicy, param: str) -> bytes:
    """The bytes at an http(s) URL, within the policy's limits, or `ImageRejected`."""
    fetch = policy.fetch
    if not fetch.enabled:
        raise ImageRejected(400, param, "this server does not download image URLs; send the "
                                        "image as a data URL (data:image/<format>;base64,<data>)")
    limit = min(fetch.max_bytes, policy.max_image_bytes)
    resolver = _CheckedResolver(fetch)
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False, force_close=True)
    try:
        async with asyncio.timeout(fetch.timeout_s), aiohttp.ClientSession(
                connector=connector, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None)) as session:
            target = _checked(url, fetch, param)
            for _ in range(fetch.max_redirects + 1):
                async with session.get(target, allow_redirects=False,
                                       headers={"Accept": "image/*"}) as response:
                    if response.status in _REDIRECTS:
                        location = response.headers.get("Location")
                        if not location:
                            raise ImageRejected(400, param, "the image URL redirected nowhere")
                        target = _checked(str(response.url.join(URL(location))), fetch, param)
                        continue
                    if response.status != 200:
                        raise ImageRejected(400, param, f"the image URL answered HTTP "
                                                        f"{response.status}")
                    return await _read(response, limit, param)
            raise ImageRejected(400, param, f"the image URL redirected more than "
                                            f"{fetch.max_redirects} times")
    except TimeoutError:
        raise ImageRejected(400, param, f"the image URL did not finish downloading within "
                                        f"{fetch.timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError, ValueError):
        if resolver.refused:
            raise _refused_address(param) from None
        raise ImageRejected(400, param, "the image URL could not be downloaded") from None
    finally:
        await connector.close()


def _checked(url: str, fetch: FetchPolicy, param: str) -> URL:
    try:
        parsed = URL(url)
        host = parsed.raw_host
    except (ValueError, TypeError):
        host = None
    if host is None or parsed.scheme not in ("http", "https"):
        raise ImageRejected(400, param, "the image URL (or a redirect) is not a valid http(s) "
                                        "URL")
    if not host_allowed(host, fetch):
        raise ImageRejected(400, param, "the image URL's host (or a redirect's) is not one this "
                                        "server downloads from")
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return parsed  # a name: the resolver checks what it resolves to
    if not address_allowed(host, fetch):
        raise _refused_address(param)
    return parsed


def _refused_address(param: str) -> ImageRejected:
    return ImageRejected(400, param, "the image URL (or a redirect) leads to a network address "
                                     "this server does not download from")


async def _read(response: Any, limit: int, param: str) -> bytes:
    too_big = ImageRejected(413, param, f"the image is larger than this server's limit of "
                                        f"{limit} bytes")
    if response.content_length is not None and response.content_length > limit:
        raise too_big
    body = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK):
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)
