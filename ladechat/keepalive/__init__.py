"""Keep-alive: a loaded model that outlives one command, as ollama keeps one (issue #30).

The first `ladechat ask` or chat that needs a model starts a detached *warm server* for it: the
app of `ladechat serve` (serve.app.Api) on a Unix socket in a private per-user folder, which the
later commands talk to with the `--api` client (backends.remote.RemoteBot). It stops after `--keep-alive` of
idle time. One server per set of load options (model, dtype, device, weights, attention,
quantization, compile); settings, sampling, the template and the store travel with each request.

    runtime.py  where the sockets live, who may use them, the lock, the key of a set of load options
    client.py   finds, starts, checks and stops warm servers; WarmBot answers through one (no torch)
    daemon.py   the server process: loads the model, serves it on the socket, expires when idle
"""
