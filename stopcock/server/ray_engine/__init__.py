"""The Ray Serve engine: the server's :class:`~stopcock.server.contract.Engine` over replicas and machines.

Three kinds of Serve deployments (:mod:`stopcock.server.ray_deploy` puts them together):

- **Ingress** replicas serve the FastAPI app of :func:`~stopcock.server.app.create_app` over a
  :class:`RayEngine`: they hold no job state, so any of them answers for any job.
- **One job registry** (:class:`JobRegistry`, one replica) is the one place where a job's start and
  its stop are ordered. It keeps every job's record (state, events, result), bounds the queue, sends
  each job to a model deployment, and routes a stop to the model replica that claimed the job, or
  keeps it as a tombstone when no replica has: a replica may start a job only after the registry
  granted it the claim, and it grants none for a stopped job. Stops and job ends are written to a
  journal before they are acknowledged, so a restarted registry loses none of them.
- **Model** replicas (:class:`ModelReplica`, one deployment per kind) each hold the model and
  ``concurrency`` lanes, the replica's device lease: a lane is taken before a job's claim and given
  back by the worker thread only once ``stopcock.run`` has returned, whatever Serve thinks of the
  request, so a replica never runs more pipelines at once than it has lanes. A replica long-polls
  the registry for stops of its jobs (applied with the same exact stop-step bookkeeping as
  :class:`~stopcock.server.engine.LocalEngine`, :mod:`stopcock.server.jobs`) and reports each job's
  events in batches.

The job's ``stop_step`` is the step its run had reached when the stop reached the replica that
runs it; the run ends at ``stop_step`` or ``stop_step + 1``. Ray is imported only by the functions
that need it: importing this module does not start or need a clust

Modules by job: :mod:`.wire` (what travels between the deployments: ``ModelSpec``, ``Refused``,
the retried call), :mod:`.ingress` (``RayEngine``), :mod:`.registry` (``JobRegistry``),
:mod:`.journal` (``Journal``), :mod:`.replica` (``ModelReplica``); the registry's parts:
:mod:`.records`, :mod:`.replicas`, :mod:`.dispatch`, :mod:`.stops`, :mod:`.operations`.
"""
