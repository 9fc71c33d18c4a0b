//! Human-readable byte sizes, both ways ("3GiB", "512MB", "1.5 GiB" ↔ bytes).

/// Formats bytes with a binary unit: `1536` → `"1.50 KiB"`.
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Parses a size such as `3GiB`, `3G`, `2.5 GB`, `800MiB` or `1048576`.
/// Binary (`KiB`, `MiB`, `GiB`, `TiB`, and bare `K`, `M`, `G`, `T`) and decimal (`KB`, `MB`,
/// `GB`, `TB`) units are accepted, case-insensitively.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        format!("'{s}' is not a size: expected a number with a unit, e.g. 3GiB or 512MB")
    })?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0f64.powi(2),
        "g" | "gib" => 1024.0f64.powi(3),
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        u => {
            return Err(format!(
                "unknown unit '{u}' in '{s}': use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"
            ));
        }
    };
    Ok((n * mult).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_bytes("3GiB").unwrap(), 3 << 30);
        assert_eq!(parse_bytes("3G").unwrap(), 3 << 30);
        assert_eq!(parse_bytes("2.5 GB").unwrap(), 2_500_000_000);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
    }
}
