"""The node's dashboard: static files served at ``/ui`` by :mod:`corral.api.observe`.

Plain HTML, CSS and JavaScript, no build step; the one library is uPlot (MIT, from the
npm registry, ``vendor/``), so nothing is fetched from the internet at run time.
"""
