"""zoo's built-in plugins, installed as the ``zoo_plugins`` package.

Each module is one plugin, registered through the ``zoo.plugins`` entry-point
group exactly as a third-party plugin would be.
"""
