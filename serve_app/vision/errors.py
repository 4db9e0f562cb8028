"""The one error a client's image turns into."""

from __future__ import annotations


class ImageRejected(Exception):
    """An image a client sent that the server will not take. `status` is 400, or 413 when it is
    too many bytes; `param` names the request field (e.g. `messages[1].content[2].image_url`);
    `message` is safe to show the client: it never holds a repr, a path or an address."""

    def __init__(self, status: int, param: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.message = message
