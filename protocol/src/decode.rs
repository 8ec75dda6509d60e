//! Decoding with precise errors.
//!
//! Every `parse_*` function of the crate goes through [`decode`]: first a direct
//! `serde_json::from_slice` into the target type (the only work done for valid input), and
//! only if that fails, a second look at the input as a [`serde_json::Value`] to say *what*
//! failed, in a fixed order: not JSON, not an object, no or unknown discriminator, then the
//! checks the caller adds (version, delegation id), then missing field, then anything else.
//!
//! serde reports a missing field only as text, `` missing field `name` ``, whose format is
//! serde's own (`serde::de::Error::missing_field`); [`classify`] reads the name from it, and a
//! unit test pins the format.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::ProtocolError;
use crate::ids::DelegationId;

/// Deserialize `bytes` as `T`; on failure, explain it. `diagnose` sees the input as a JSON
/// object and returns the context for later errors (e.g. `INVITE message`) or its own error.
pub(crate) fn decode<T: DeserializeOwned>(
    bytes: &[u8],
    diagnose: impl FnOnce(&Map<String, Value>) -> Result<String, ProtocolError>,
) -> Result<T, ProtocolError> {
    let first = match serde_json::from_slice::<T>(bytes) {
        Ok(value) => return Ok(value),
        Err(e) => e,
    };
    if !first.is_data() {
        return Err(malformed(first));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(malformed)?;
    let Value::Object(obj) = &value else {
        return Err(ProtocolError::NotAnObject {
            found: json_kind(&value),
        });
    };
    let context = diagnose(obj)?;
    serde_json::from_value::<T>(value).map_err(|e| classify(e, context))
}

/// Read the discriminator `field` (e.g. `type`) of `obj` and check it is one of `known`.
pub(crate) fn discriminator<'a>(
    obj: &'a Map<String, Value>,
    field: &str,
    what: &'static str,
    known: &[&str],
) -> Result<&'a str, ProtocolError> {
    let Some(value) = obj.get(field) else {
        return Err(ProtocolError::MissingField {
            context: what.to_owned(),
            field: field.to_owned(),
        });
    };
    match value.as_str() {
        Some(s) if known.contains(&s) => Ok(s),
        Some(s) => Err(ProtocolError::UnknownType {
            what,
            received: s.to_owned(),
        }),
        None => Err(ProtocolError::UnknownType {
            what,
            received: value.to_string(),
        }),
    }
}

/// Check `delegationId` if it is present and a string; other problems with it are left to
/// the deserializer's message.
pub(crate) fn check_delegation_id(obj: &Map<String, Value>) -> Result<(), ProtocolError> {
    match obj.get("delegationId").and_then(Value::as_str) {
        Some(s) => DelegationId::parse(s).map(drop),
        None => Ok(()),
    }
}

/// Turn a deserialization error into [`ProtocolError::MissingField`] when it is one, else
/// [`ProtocolError::InvalidField`].
pub(crate) fn classify(err: serde_json::Error, context: String) -> ProtocolError {
    let text = err.to_string();
    let field = text
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(name, _)| name.to_owned());
    match field {
        Some(field) => ProtocolError::MissingField { context, field },
        None => ProtocolError::InvalidField {
            context,
            source: err,
        },
    }
}

fn malformed(err: serde_json::Error) -> ProtocolError {
    ProtocolError::MalformedJson {
        line: err.line(),
        column: err.column(),
        source: err,
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::TaskSpec;

    #[test]
    fn serde_missing_field_text_is_still_recognised() {
        let err =
            serde_json::from_value::<TaskSpec>(serde_json::json!({"prompt": "p"})).unwrap_err();
        match classify(err, "thing".into()) {
            ProtocolError::MissingField { context, field } => {
                assert_eq!(context, "thing");
                assert_eq!(field, "description");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn wrong_type_is_invalid_not_missing() {
        let err = serde_json::from_value::<TaskSpec>(
            serde_json::json!({"description": 3, "prompt": "p"}),
        )
        .unwrap_err();
        assert!(matches!(
            classify(err, "thing".into()),
            ProtocolError::InvalidField { .. }
        ));
    }
}
