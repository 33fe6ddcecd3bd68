"""A real SMTP server on loopback (aiosmtpd) that records what it receives.

``sink.replies[address] = ["451 4.3.0 try later"]`` answers the next RCPT TO
of that address with each reply in turn (then accepts it);
``sink.always[address] = "550 5.1.1 no such user"`` answers it every time;
``sink.after_data[address]`` answers the end of DATA instead of accepting.
"""

import email
import email.policy
import threading

from aiosmtpd.controller import Controller

from helpers import free_port


class SmtpSink:
    def __init__(self, **controller_options):
        self.messages = []          # (mail_from, [rcpt], raw bytes), in arrival order
        self.replies, self.always, self.after_data = {}, {}, {}
        self.lock = threading.Lock()
        self.port = free_port()
        self.controller = Controller(self, hostname="127.0.0.1", port=self.port,
                                     **controller_options)

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def start(self):
        self.controller.start()
        return self

    def stop(self):
        self.controller.stop()

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        with self.lock:
            queued = self.replies.get(address)
            if queued:
                return queued.pop(0)
            if address in self.always:
                return self.always[address]
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        with self.lock:
            refusal = self.after_data.get(envelope.rcpt_tos[0])
            if refusal:
                return refusal
            self.messages.append((envelope.mail_from, list(envelope.rcpt_tos), envelope.content))
        return "250 OK"

    def parsed(self):
        """The received emails, parsed with the email package, by recipient
        (line ends as Python's: SMTP's CRLF become LF)."""
        with self.lock:
            return {rcpts[0]: email.message_from_bytes(raw.replace(b"\r\n", b"\n"),
                                                       policy=email.policy.default)
                    for _, rcpts, raw in self.messages}

    def count(self):
        with self.lock:
            return len(self.messages)


class PipeliningSink(SmtpSink):
    """The same, offering PIPELINING (RFC 2920) as real relays do; records
    how the commands of each transaction arrived."""

    async def handle_EHLO(self, server, session, envelope, hostname, responses):
        session.host_name = hostname
        return responses[:-1] + ["250-PIPELINING", responses[-1]]
