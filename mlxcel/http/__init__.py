"""HTTP plumbing shared by a serving node (:mod:`mlxcel.server`) and a router (:mod:`mlxcel.router`).

The app factory (request scope, API-key gate, OpenAI-shaped errors), the
listener (hypercorn's trio worker with bounded connections and a send
timeout), the transport guard, graceful shutdown on signals, and a wait for the first of
several events (``waits``). Never imports mlx.
"""
