//! Integer fields of the admin API's JSON bodies. JSON Schema counts `7.0`
//! as an integer, serde does not; these accept any integral JSON number in
//! range and refuse the rest with a message naming the problem.

use serde::{Deserialize, Deserializer, de::Error};

fn integral<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let n = serde_json::Number::deserialize(d)?;
    if let Some(v) = n.as_u64() {
        return Ok(v);
    }
    match n.as_f64() {
        Some(f) if f >= 0.0 && f.fract() == 0.0 && f <= u64::MAX as f64 => Ok(f as u64),
        _ => Err(D::Error::custom(format!("{n} is not a non-negative integer"))),
    }
}

pub fn int<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<T, D::Error> {
    let v = integral(d)?;
    T::try_from(v).map_err(|_| D::Error::custom(format!("{v} is out of range")))
}

pub fn opt_int<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<Option<T>, D::Error> {
    let v: Option<serde_json::Number> = Option::deserialize(d)?;
    match v {
        None => Ok(None),
        Some(n) => int(n).map(Some).map_err(D::Error::custom),
    }
}

#[cfg(test)]
mod tests {
    #[derive(serde::Deserialize, Debug)]
    struct Body {
        #[serde(deserialize_with = "super::int")]
        a: u32,
        #[serde(default, deserialize_with = "super::opt_int")]
        b: Option<u32>,
    }

    #[test]
    fn integral_numbers_in_range_only() {
        let ok: Body = serde_json::from_str(r#"{"a": 7.0, "b": 3}"#).unwrap();
        assert_eq!((ok.a, ok.b), (7, Some(3)));
        assert_eq!(serde_json::from_str::<Body>(r#"{"a": 1, "b": null}"#).unwrap().b, None);
        assert_eq!(serde_json::from_str::<Body>(r#"{"a": 1}"#).unwrap().b, None);
        for bad in [r#"{"a": 7.5}"#, r#"{"a": -1}"#, r#"{"a": 4294967296}"#, r#"{"a": "7"}"#, r#"{"a": 1e300}"#] {
            assert!(serde_json::from_str::<Body>(bad).is_err(), "{bad}");
        }
    }
}
