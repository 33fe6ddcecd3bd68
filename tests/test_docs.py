"""The README's route table is the route table: a route added, removed or
changed without the README following fails here."""

import os

import campaignapi

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def route_rows():
    rows = []
    for route in campaignapi.ROUTES:
        params = " ".join(f"**{p.name}**" if p.required else p.name
                          for p in route.params.values())
        path = "/v1" + route.path.replace("|", "\\|")
        rows.append(f"| {route.method} | `{path}` | {route.level or 'none'} | {params} |")
    return rows


def test_readme_lists_every_route_as_the_route_table_has_it():
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = lines.index("| method | path | level | parameters (**required**) |") + 2
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert lines[start:end] == route_rows(), (
        "README.md's route table differs from campaignapi.ROUTES; the expected rows:\n"
        + "\n".join(route_rows()))
