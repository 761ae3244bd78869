//! What the console's browser test needs: Chromium and its WebDriver, from Debian's
//! `chromium` and `chromium-driver` packages (tests/cli/console_browser.rs drives them).

use std::process::Command;

use crate::Result;

/// Where the Debian packages put the browser and its driver; the test looks there too.
const PROGRAMS: [(&str, &str); 2] = [
    ("/usr/bin/chromium", "chromium"),
    ("/usr/bin/chromedriver", "chromium-driver"),
];

/// Installs Chromium and chromedriver with apt-get when either is missing (once with the
/// package lists as they are, then after `apt-get update`, as a fresh image has none).
pub fn ensure() -> Result {
    let missing: Vec<&str> = PROGRAMS
        .iter()
        .filter(|(path, _)| !std::path::Path::new(path).is_file())
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    println!(
        "xtask: the console's browser test needs {}; installing with apt-get",
        missing.join(", ")
    );
    let install = || {
        crate::run(
            Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends"])
                .args(&missing),
        )
    };
    if install().is_err() {
        crate::run(Command::new("apt-get").arg("update"))?;
        install().map_err(|e| {
            format!(
                "{e}: the console's browser test needs Debian packages {} (run as root, or install them)",
                missing.join(" and ")
            )
        })?;
    }
    Ok(())
}
