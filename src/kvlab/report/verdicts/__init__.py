"""The verdict functions of the claims table (kvlab.report.claims), grouped by the stage whose rows they read.

Each takes the report's query results (name in queries.sql → frame) and the claim's thresholds, and returns
one (subject, verdict, evidence) per thing judged: subject is appended to the claim's title (e.g. ' on
<model>'), evidence is the numbers behind the verdict (the claims table appends the rule).
"""
