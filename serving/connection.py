"""The connection side of the server: keepalive.

Keepalive (`KEEPALIVE_OPTIONS`). gRPC servers by default take a client's ping sent less than 5 minutes after the
previous one, while the server sends nothing, as abuse, and the third such ping closes the connection (GOAWAY
ENHANCE_YOUR_CALM "too_many_pings"); a ping on a connection without calls is abuse unless permitted. The SMG
gateway pings its workers every 30 s whether or not calls are open (10 s timeout), and a long prefill or an idle
connection sends nothing, so with the defaults the gateway's connection would be cut in the middle of a prefill.
The server therefore permits pings without calls (as vLLM's gRPC server does) and takes pings as often as every
second: its floor is half that, as timer and scheduling jitter can bring two pings a second apart closer together
on arrival, and strikes add up for as long as the server sends nothing. gRPC's own limit of two strikes is kept,
so a client pinging faster than the floor is still cut off. The server pings each connection itself every 30 s
(gRPC's default: 2 hours) and closes it when no ack comes within 20 s (gRPC's default), also while it sends no
data (by default it stops pinging after two pings without data), so the streams of a client that vanished without
closing its connection (a dead host, a partition) are cancelled, and their slots freed, within a minute. The
option that sets the floor is `grpc.http2.min_ping_interval_without_data_ms`: gRPC core's C macro calls it
GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, but a `grpc.http2.min_recv_ping_interval_without_data_ms`
option (a name some servers pass) is no option of gRPC's and is silently ignored.
"""

KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
)
