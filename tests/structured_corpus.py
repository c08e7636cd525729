"""JSON schemas written for the structured-output tests: nested objects, arrays with min/maxItems,
enums, anyOf/oneOf, $ref/$defs, string patterns and formats, bounded numbers,
additionalProperties: false, required subsets. Strings and arrays are bounded so that a 135M model
ends its output by the schema rather than by max_tokens. Each entry: (a user request, the schema)."""

from __future__ import annotations


def obj(properties: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties) if required is None else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


def s(max_length: int = 16, **kw) -> dict:
    return {"type": "string", "maxLength": max_length, **kw}


INT = {"type": "integer", "minimum": 0, "maximum": 1000}
NUM = {"type": "number", "minimum": -100, "maximum": 100}
BOOL = {"type": "boolean"}
COLOR = {"enum": ["red", "green", "blue"]}
POINT = {"$ref": "#/$defs/point"}
DEFS = {"point": obj({"x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}})}

SCHEMAS: list[tuple[str, dict]] = [
    ("A person.", obj({"name": s(), "age": INT})),
    ("A city and its country.", obj({"city": s(), "country": s()})),
    ("A product with a price.", obj({"product": s(), "price": {"type": "number", "minimum": 0, "maximum": 999}})),
    ("Is the sky blue?", obj({"answer": BOOL})),
    ("Pick a color.", obj({"color": COLOR})),
    ("A book.", obj({"title": s(24), "author": s(), "year": {"type": "integer", "minimum": 1500, "maximum": 2030}})),
    ("A list of fruits.", obj({"fruits": {"type": "array", "items": s(10), "minItems": 1, "maxItems": 3}})),
    ("Three numbers.", obj({"numbers": {"type": "array", "items": INT, "minItems": 3, "maxItems": 3}})),
    ("A point.", {"$defs": DEFS, **obj({"p": POINT})}),
    ("A line from one point to another.", {"$defs": DEFS, **obj({"start": POINT, "end": POINT})}),
    ("A polygon.", {"$defs": DEFS, **obj({"points": {"type": "array", "items": POINT, "minItems": 1, "maxItems": 3}})}),
    ("A user with an address.", obj({"name": s(), "address": obj({"street": s(20), "zip": s(5, pattern="^[0-9]{5}$")})})),
    ("A US phone number.", obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}})),
    ("An email address.", obj({"email": {"type": "string", "format": "email", "maxLength": 30}})),
    ("A date.", obj({"date": {"type": "string", "format": "date"}})),
    ("A time of day.", obj({"time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}})),
    ("A temperature reading.", obj({"celsius": NUM, "unit": {"const": "C"}})),
    ("A shape: circle or square.", obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "radius": INT}),
                                                            obj({"kind": {"const": "square"}, "side": INT})]}})),
    ("An id, number or text.", obj({"id": {"anyOf": [INT, s(8, pattern="^[a-z]+$")]}})),
    ("Optional nickname.", obj({"name": s(), "nickname": s()}, required=["name"])),
    ("A task with a priority.", obj({"task": s(20), "priority": {"enum": ["low", "medium", "high"]}, "done": BOOL})),
    ("A matrix.", obj({"rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                             "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}})),
    ("A team of people.", obj({"team": s(), "members": {"type": "array", "items": obj({"name": s(10), "role": COLOR}), "maxItems": 2}})),
    ("Tags.", obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "minItems": 1, "maxItems": 4}})),
    ("A rating from 1 to 5.", obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("A probability.", obj({"p": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("A nullable middle name.", obj({"first": s(), "middle": {"anyOf": [s(), {"type": "null"}]}})),
    ("An hex color code.", obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("A version string.", obj({"version": {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"}})),
    ("A yes/no answer.", {"enum": ["yes", "no"]}),
    ("A number.", {"type": "integer", "minimum": 0, "maximum": 100}),
    ("A short word.", {"type": "string", "maxLength": 12}),
    ("A list of points.", {"$defs": DEFS, "type": "array", "items": POINT, "minItems": 1, "maxItems": 2}),
    ("A config with flags.", obj({"debug": BOOL, "verbose": BOOL, "level": {"type": "integer", "minimum": 0, "maximum": 3}})),
    ("A pet.", obj({"species": {"enum": ["cat", "dog", "fish"]}, "name": s(10), "age": {"type": "integer", "minimum": 0, "maximum": 30}})),
    ("A recipe.", obj({"dish": s(), "ingredients": {"type": "array", "items": s(12), "minItems": 1, "maxItems": 3},
                       "minutes": {"type": "integer", "minimum": 1, "maximum": 240}})),
    ("A weather report.", obj({"city": s(), "temp": NUM, "sky": {"enum": ["sunny", "cloudy", "rain"]}})),
    ("A key-value pair.", obj({"key": s(8, pattern="^[a-z_]+$"), "value": {"anyOf": [INT, BOOL, s(8)]}})),
    ("An order.", {"$defs": {"item": obj({"sku": s(6, pattern="^[A-Z0-9]+$"), "qty": {"type": "integer", "minimum": 1, "maximum": 9}})},
                   **obj({"order_id": INT, "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}})}),
    ("A tree node.", {"$defs": {"leaf": obj({"value": INT})}, **obj({"value": INT, "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"},
                                                                                              "maxItems": 2}})}),
    ("Coordinates.", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("A status.", obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}, required=["status"])),
]


# Chains the grammar library follows recursively in native code (issue #75): a thread's 8 MiB stack
# overflowed at ~950 chained schema definitions and ~2,800 chained rules.

def ref_chain_schema(n: int) -> dict:
    """n object definitions, each's only property the next: the library follows the chain recursively."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def rule_chain_grammar(n: int, alternative: bool = False) -> str:
    """n rules, each the next one's prefix: "a" r1, or (alternative) r1 | "0"."""
    body = (lambda i: f'r{i + 1} | "0"') if alternative else (lambda i: f'"a" r{i + 1}')
    return "start: r0\n" + "".join(f"r{i}: {body(i)}\n" for i in range(n)) + f'r{n}: "end"\n'
