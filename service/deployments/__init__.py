"""The Ray Serve deployments of a gangserve app, in one place: shells over the packages below.

    Ingress      (ingress.py)      HTTP only: parses, validates, forwards; 0 CPUs, spread over nodes
    GangServer   (gang_server.py)  one gang per replica: rank 0 + the peer rank actors, supervised
    JobManager   (job_manager.py)  training jobs (service.training.jobs): the job store, the run actors
    Controller   (controller.py)   the fleet view and the served-weights record: the app's shared state

`service.app.compose_app` binds them together. Everything they use lives below them (the
subsystems service.ingress, service.gang and service.training, and the shared packages:
service.weights, service.state, service.metrics, service.cluster, ...); nothing below imports
from here (tests/test_layout.py).
"""
