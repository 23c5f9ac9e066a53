"""The Ansible inventory: hosts, groups and vars, read by Ansible's own loader or by the
fast readers of the same formats (INI, YAML), which load 12,500 hosts in a second.

May import: nothing but the root.
"""
