//! Summing counters of several mounts or exports (one per resource) into one JSON object
//! of the same shape, so a reader of one resource's counters reads the sum the same way.

use serde_json::{Map, Value};

/// Field by field: numbers (unsigned) are added, objects summed recursively, arrays
/// concatenated, booleans or-ed; anything else (strings) is taken from the first value.
pub(crate) fn sum(values: &[Value]) -> Value {
    let Some(first) = values.first() else {
        return Value::Null;
    };
    match first {
        Value::Number(_) => Value::from(
            values
                .iter()
                .filter_map(Value::as_u64)
                .fold(0u64, u64::saturating_add),
        ),
        Value::Bool(_) => Value::Bool(values.iter().any(|v| v.as_bool() == Some(true))),
        Value::Array(_) => Value::Array(
            values
                .iter()
                .filter_map(Value::as_array)
                .flatten()
                .cloned()
                .collect(),
        ),
        Value::Object(o) => {
            let mut out = Map::new();
            for k in o.keys() {
                let field: Vec<Value> = values.iter().filter_map(|v| v.get(k)).cloned().collect();
                out.insert(k.clone(), sum(&field));
            }
            Value::Object(out)
        }
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sums_counters_keeps_strings_or_s_flags() {
        let a =
            json!({"state": "mounted", "unsynced": false, "n": 2, "ops": {"read": 1}, "c": [1]});
        let b = json!({"state": "fenced", "unsynced": true, "n": 3, "ops": {"read": 4}, "c": [2]});
        assert_eq!(
            sum(&[a, b]),
            json!({"state": "mounted", "unsynced": true, "n": 5, "ops": {"read": 5}, "c": [1, 2]})
        );
        assert_eq!(sum(&[]), Value::Null);
    }
}
