"""``pagoda serve --replicas N``: N engine replicas behind one OpenAI endpoint, on Ray Serve.

- :mod:`.forward`: an HTTP request as it travels from the ingress to a replica, and running a replica's
  pagoda app on it in-process.
- :mod:`.ray_router`: Ray Serve's request router calling a pagoda router (``pagoda_routers``).
- :mod:`.deployments`: the ingress and engine replica deployments, and the Serve application.
- :mod:`.autoscaling`: the Serve autoscaling policy reading the replicas' waiting and running requests.

Nothing here imports Ray until a replica set starts.
"""
