"""Isolated execution of untrusted code: a docker warm pool and a bubblewrap fallback.

Not built yet; environments that run model-written code will import it from here.
"""
