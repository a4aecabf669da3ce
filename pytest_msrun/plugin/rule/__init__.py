"""The rule: pure data and decisions, no pytest - the record format, a test's record, the verdict
rule and its words. Read by msrun's job-end reporter as by the controller.

It imports nothing else of the plugin.
"""
